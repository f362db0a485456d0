// Renders deploy/k8s with `kubectl kustomize` (the kubectl on PATH, or
// $KUBECTL) and checks what a reviewer of the manifests would: every overlay
// renders; every container is probed, limited and runs as non-root; every
// port a probe, Service, NetworkPolicy, PodMonitor or scrape annotation names
// exists on the container; every flag is one the binary's --help lists; every
// $(VAR) resolves; the coordinator keeps its state on a claim, the workers
// register with the coordinator's Service and advertise a reachable address;
// the gpu overlay is a GPU deployment with nothing of the CPU one left; the
// TLS component turns on TLS everywhere and turns the probes into exec probes;
// the submit Job's job file is a JobSpec the coordinator accepts.
//
// Components (kind: Component, kustomize >= 3.7) are rendered only when the
// kubectl's kustomize has them; otherwise the tests that need them are
// reported as SKIPPED with the reason. Nothing contacts a cluster.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/job_file.h"
#include "gtest/gtest.h"
#include "spec/job_validation.h"
#include "tests/testing/temp_dir.h"
#include "yaml-cpp/yaml.h"

namespace colod {
namespace {

namespace fs = std::filesystem;
using ::colod::testing::TempPath;

constexpr char kCoordinator[] = "colod-coordinator";
constexpr char kWorker[] = "colod-worker";
constexpr char kColoctl[] = "coloctl";

// ---------------------------------------------------------------------------
// Processes and files.

struct CommandResult {
  int code = -1;  // -1: did not finish in time (killed)
  std::string out;
  std::string err;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

CommandResult Run(const std::vector<std::string>& argv, absl::Duration timeout = absl::Seconds(120)) {
  static int counter = 0;
  const std::string out = TempPath(absl::StrCat("run", ++counter, ".out"));
  const std::string err = TempPath(absl::StrCat("run", counter, ".err"));
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(o, 1);
    ::dup2(e, 2);
    std::vector<std::string> copy = argv;
    std::vector<char*> args;
    for (std::string& a : copy) args.push_back(a.data());
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    _exit(127);
  }
  CommandResult r;
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int st = 0;
    if (::waitpid(pid, &st, WNOHANG) == pid) {
      r.code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      break;
    }
    if (absl::Now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &st, 0);
      break;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  r.out = ReadFile(out);
  r.err = ReadFile(err);
  return r;
}

std::string FindKubectl() {
  const char* env = std::getenv("KUBECTL");
  if (env != nullptr && env[0] != '\0') return env;
  const char* path = std::getenv("PATH");
  for (absl::string_view dir : absl::StrSplit(path != nullptr ? path : "/usr/bin", ':', absl::SkipEmpty())) {
    const std::string candidate = absl::StrCat(dir, "/kubectl");
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// ---------------------------------------------------------------------------
// The binaries' flags, from their --help.

struct Help {
  std::string text;
  std::map<std::string, bool> flags;  // dashed name -> is a bool flag
};

Help ParseHelp(const std::string& text) {
  Help h;
  h.text = text;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::ConsumePrefix(&line, "  --")) continue;
    const size_t end = line.find_first_of(" ,");
    const std::string name(line.substr(0, end));
    const bool is_bool = absl::StrContains(line, "(default: false)") || absl::StrContains(line, "(default: true)");
    h.flags[name] = is_bool;
  }
  return h;
}

struct ParsedArgs {
  std::vector<std::pair<std::string, std::string>> flags;  // dashed name, value
  std::vector<std::string> positional;
  std::vector<std::string> errors;

  std::optional<std::string> Flag(const std::string& name) const {
    std::optional<std::string> v;
    for (const auto& [n, value] : flags) {
      if (n == name) v = value;
    }
    return v;
  }
  int Count(const std::string& name) const {
    return static_cast<int>(std::count_if(flags.begin(), flags.end(), [&](const auto& f) { return f.first == name; }));
  }
};

// Parses argv[1:] the way Abseil does for `binary`: --name=value, --name value
// (not for bools), --bool, --nobool; dashes and underscores alike.
ParsedArgs ParseArgs(const std::vector<std::string>& args, const Help& help, const std::string& binary) {
  ParsedArgs p;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      p.positional.insert(p.positional.end(), args.begin() + i + 1, args.end());
      break;
    }
    if (a.size() < 2 || a[0] != '-') {
      p.positional.push_back(a);
      continue;
    }
    std::string body = a.substr(a[1] == '-' ? 2 : 1);
    std::string name = body.substr(0, body.find('='));
    std::replace(name.begin(), name.end(), '_', '-');
    const bool has_value = body.find('=') != std::string::npos;
    std::string value = has_value ? body.substr(body.find('=') + 1) : "";
    auto it = help.flags.find(name);
    if (it == help.flags.end() && absl::StartsWith(name, "no") && !has_value) {
      auto negated = help.flags.find(name.substr(2));
      if (negated != help.flags.end() && negated->second) {
        p.flags.emplace_back(name.substr(2), "false");
        continue;
      }
    }
    if (it == help.flags.end()) {
      p.errors.push_back(absl::StrCat("flag '", a, "' is not in `", binary, " --help`"));
      continue;
    }
    if (!has_value) {
      if (it->second) {
        value = "true";
      } else if (i + 1 < args.size()) {
        value = args[++i];
      } else {
        p.errors.push_back(absl::StrCat("flag '", a, "' of ", binary, " has no value"));
      }
    }
    p.flags.emplace_back(name, value);
  }
  return p;
}

// ---------------------------------------------------------------------------
// Manifests.

// n[k0][k1]...: an undefined node if any key is missing (yaml-cpp throws on a
// subscript of a missing key's node).
YAML::Node Get(const YAML::Node& n, std::initializer_list<std::string> path) {
  YAML::Node cur(n);
  for (const std::string& k : path) {
    if (!cur.IsDefined() || !cur.IsMap()) return YAML::Node(YAML::NodeType::Undefined);
    const YAML::Node next = static_cast<const YAML::Node&>(cur)[k];
    if (!next.IsDefined()) return YAML::Node(YAML::NodeType::Undefined);
    cur.reset(next);  // rebinds; `cur = next` would overwrite the document
  }
  return cur;
}

std::string Str(const YAML::Node& n) { return n && n.IsScalar() ? n.Scalar() : ""; }

std::vector<std::string> Strings(const YAML::Node& n) {
  std::vector<std::string> out;
  if (n && n.IsSequence()) {
    for (const YAML::Node& e : n) out.push_back(Str(e));
  }
  return out;
}

std::string Kind(const YAML::Node& d) { return Str(d["kind"]); }
std::string Name(const YAML::Node& d) { return Str(Get(d, {"metadata", "name"})); }

bool IsWorkload(const YAML::Node& d) {
  static const std::set<std::string> kinds = {"StatefulSet", "Deployment", "DaemonSet", "ReplicaSet", "Job"};
  return kinds.count(Kind(d)) > 0;
}

YAML::Node PodTemplate(const YAML::Node& d) { return Get(d, {"spec", "template"}); }

std::map<std::string, std::string> StringMap(const YAML::Node& n) {
  std::map<std::string, std::string> m;
  if (n && n.IsMap()) {
    for (const auto& kv : n) m[kv.first.Scalar()] = Str(kv.second);
  }
  return m;
}

bool LabelsMatch(const std::map<std::string, std::string>& selector, const std::map<std::string, std::string>& labels) {
  for (const auto& [k, v] : selector) {
    auto it = labels.find(k);
    if (it == labels.end() || it->second != v) return false;
  }
  return true;
}

// A LabelSelector (matchLabels and matchExpressions In/NotIn/Exists/DoesNotExist).
bool SelectorMatches(const YAML::Node& selector, const std::map<std::string, std::string>& labels) {
  if (!LabelsMatch(StringMap(selector["matchLabels"]), labels)) return false;
  for (const YAML::Node& e : selector["matchExpressions"]) {
    const std::string key = Str(e["key"]), op = Str(e["operator"]);
    const std::vector<std::string> values = Strings(e["values"]);
    auto it = labels.find(key);
    const bool in = it != labels.end() && std::find(values.begin(), values.end(), it->second) != values.end();
    if ((op == "In" && !in) || (op == "NotIn" && in) || (op == "Exists" && it == labels.end()) ||
        (op == "DoesNotExist" && it != labels.end())) {
      return false;
    }
  }
  return true;
}

bool Contains(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

std::string Basename(const std::string& path) { return path.substr(path.find_last_of('/') + 1); }

// "registry/colod-cuda:1.0" -> "colod-cuda".
std::string ImageName(const std::string& image) {
  std::string s = image.substr(0, image.find('@'));
  s = s.substr(s.find_last_of('/') + 1);
  return s.substr(0, s.find(':'));
}

std::vector<std::string> VarRefs(const std::string& s) {
  static const std::regex re(R"(\$\(([A-Za-z_][A-Za-z0-9_]*)\))");
  std::vector<std::string> out;
  for (auto it = std::sregex_iterator(s.begin(), s.end(), re); it != std::sregex_iterator(); ++it) {
    out.push_back((*it)[1].str());
  }
  return out;
}

// Go/Abseil durations as the daemons take them: 2m, 90s, 1m30s, 1h.
std::optional<double> DurationSeconds(const std::string& s) {
  absl::Duration d;
  if (!absl::ParseDuration(s, &d)) return std::nullopt;
  return absl::ToDoubleSeconds(d);
}

// One container of one workload, with what the checks need.
struct Container {
  std::string where;  // "overlays/gpu: StatefulSet/colod-worker container worker"
  YAML::Node doc;     // the workload
  YAML::Node pod;     // its pod spec
  YAML::Node c;
  std::string binary;             // basename of command[0]
  std::vector<std::string> args;  // command[1:] + args
  ParsedArgs parsed;

  bool HasPort(int port) const {
    for (const YAML::Node& p : c["ports"]) {
      if (Str(p["containerPort"]) == std::to_string(port)) return true;
    }
    return false;
  }
  bool HasPortName(const std::string& name) const {
    for (const YAML::Node& p : c["ports"]) {
      if (Str(p["name"]) == name) return true;
    }
    return false;
  }
  // A port given as a number or a name (targetPort, probe port).
  bool HasPortRef(const std::string& ref) const {
    int n;
    return absl::SimpleAtoi(ref, &n) ? HasPort(n) : HasPortName(ref);
  }
  int PortNumber(const std::string& name) const {
    for (const YAML::Node& p : c["ports"]) {
      if (Str(p["name"]) == name) return p["containerPort"].as<int>();
    }
    return -1;
  }
  YAML::Node Env(const std::string& name) const {
    for (const YAML::Node& e : c["env"]) {
      if (Str(e["name"]) == name) return e;
    }
    return YAML::Node();
  }
  // The volume mounted at a directory that contains `path`, and that mount.
  std::optional<std::pair<YAML::Node, YAML::Node>> VolumeFor(const std::string& path) const {
    std::optional<std::pair<YAML::Node, YAML::Node>> best;
    size_t best_len = 0;
    for (const YAML::Node& m : c["volumeMounts"]) {
      const std::string mp = Str(m["mountPath"]);
      if ((path == mp || absl::StartsWith(path, mp + "/")) && mp.size() >= best_len) {
        for (const YAML::Node& v : pod["volumes"]) {
          if (Str(v["name"]) == Str(m["name"])) {
            best.emplace(v, m);
            best_len = mp.size();
          }
        }
        for (const YAML::Node& t : Get(doc, {"spec", "volumeClaimTemplates"})) {
          if (Name(t) == Str(m["name"])) {
            YAML::Node v;
            v["name"] = Name(t);
            v["persistentVolumeClaim"]["claimName"] = Name(t);
            best.emplace(v, m);
            best_len = mp.size();
          }
        }
      }
    }
    return best;
  }
  std::map<std::string, std::string> PodLabels() const {
    return StringMap(Get(PodTemplate(doc), {"metadata", "labels"}));
  }
};

struct Render {
  std::string name;  // "overlays/cpu", "submit", "cpu+tls", ...
  bool ok = false;
  std::string error;
  std::vector<YAML::Node> docs;
  bool tls = false;
  bool gpu = false;
  bool cpu = false;
  bool nccl_net = false;  // components/nccl-secondary-network

  std::vector<YAML::Node> OfKind(const std::string& kind) const {
    std::vector<YAML::Node> out;
    for (const YAML::Node& d : docs) {
      if (Kind(d) == kind) out.push_back(d);
    }
    return out;
  }
  YAML::Node Find(const std::string& kind, const std::string& name) const {
    for (const YAML::Node& d : docs) {
      if (Kind(d) == kind && Name(d) == name) return d;
    }
    return YAML::Node();
  }
};

struct World {
  std::string error;  // set: nothing can be checked
  std::string kubectl;
  std::string version;
  bool components = false;
  std::string components_note;
  fs::path root;
  std::map<std::string, Help> help;
  std::vector<Render> renders;
};

CommandResult Kustomize(const World& s, const fs::path& dir) { return Run({s.kubectl, "kustomize", dir.string()}); }

Render RenderDir(const World& s, const std::string& name, const fs::path& dir) {
  Render r;
  r.name = name;
  r.tls = absl::StrContains(name, "tls");
  r.gpu = absl::StrContains(name, "gpu");
  r.cpu = absl::StrContains(name, "cpu");
  r.nccl_net = absl::StrContains(name, "nccl-secondary-network");
  const CommandResult k = Kustomize(s, dir);
  if (k.code != 0) {
    r.error = absl::StrCat("`kubectl kustomize ", dir.string(), "` exited ", k.code, ": ", k.err);
    return r;
  }
  try {
    for (const YAML::Node& d : YAML::LoadAll(k.out)) {
      if (d && d.IsMap()) r.docs.push_back(d);
    }
  } catch (const YAML::Exception& e) {
    r.error = absl::StrCat("output of `kubectl kustomize ", dir.string(), "` is not YAML: ", e.what());
    return r;
  }
  r.ok = !r.docs.empty();
  if (!r.ok) r.error = "rendered nothing";
  return r;
}

void WriteFile(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path) << text;
}

// A kustomization in the copied tree that combines `resource` with components.
fs::path Combine(const World& s, const std::string& name, const std::string& resource,
                 const std::vector<std::string>& components) {
  const fs::path dir = s.root / "_test" / name;
  std::string text = absl::StrCat("resources:\n- ../../", resource, "\ncomponents:\n");
  for (const std::string& c : components) absl::StrAppend(&text, "- ../../components/", c, "\n");
  WriteFile(dir / "kustomization.yaml", text);
  return dir;
}

World MakeWorld() {
  World s;
  s.kubectl = FindKubectl();
  if (s.kubectl.empty()) {
    s.error =
        "no kubectl on PATH (install Debian's package `kubernetes-client`, or run with "
        "--test_env=KUBECTL=/path/to/kubectl)";
    return s;
  }
  if (const char* home = std::getenv("HOME"); home == nullptr || home[0] == '\0') {
    ::setenv("HOME", TempPath("").c_str(), 1);
  }
  const CommandResult v = Run({s.kubectl, "version", "--client"});
  s.version = absl::StrCat(absl::StripAsciiWhitespace(v.out), v.code != 0 ? absl::StrCat(" ", v.err) : "");
  std::cout << "kubectl: " << s.kubectl << "\n" << s.version << "\n";

  // kustomize refuses files that resolve outside the kustomization's root,
  // and runfiles are symlinks into the source tree: render a real copy.
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const fs::path src = fs::path(srcdir != nullptr ? srcdir : ".") / "colod" / "deploy" / "k8s";
  s.root = TempPath("k8s");
  std::error_code ec;
  fs::remove_all(s.root, ec);
  fs::copy(src, s.root, fs::copy_options::recursive, ec);
  if (ec || !fs::exists(s.root / "base" / "kustomization.yaml")) {
    s.error = absl::StrCat("cannot copy ", src.string(), " to ", s.root.string(), ": ", ec.message());
    return s;
  }

  for (const auto& [binary, path] :
       std::vector<std::pair<std::string, std::string>>{{kCoordinator, "server/colod-coordinator"},
                                                        {kWorker, "worker/daemon/colod-worker"},
                                                        {kColoctl, "client/coloctl"}}) {
    const CommandResult h = Run({(fs::path(srcdir != nullptr ? srcdir : ".") / "colod" / path).string(), "--help"});
    if (h.code != 0 || !absl::StrContains(h.out, "--")) {
      s.error = absl::StrCat(path, " --help exited ", h.code, ": ", h.err);
      return s;
    }
    s.help[binary] = ParseHelp(h.out);
  }

  // Does this kustomize know components? A one-line probe, so that an
  // unrelated error in a real component is not taken for "unsupported".
  WriteFile(s.root / "_probe" / "kustomization.yaml", "components:\n- comp\n");
  WriteFile(s.root / "_probe" / "comp" / "kustomization.yaml",
            "apiVersion: kustomize.config.k8s.io/v1alpha1\nkind: Component\nresources:\n- cm.yaml\n");
  WriteFile(s.root / "_probe" / "comp" / "cm.yaml",
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: probe\ndata:\n  a: b\n");
  const CommandResult probe = Kustomize(s, s.root / "_probe");
  if (probe.code == 0 && absl::StrContains(probe.out, "name: probe")) {
    s.components = true;
  } else if (absl::StrContains(probe.err, "components")) {
    s.components_note = absl::StrCat(
        "this kubectl's kustomize has no components (kind: Component needs kustomize >= 3.7, kubectl >= 1.21): "
        "components/tls, components/shared-storage, components/podmonitor and components/nccl-secondary-network "
        "were NOT rendered or checked. ",
        "kustomize said: ", absl::StripAsciiWhitespace(probe.err));
    std::cout << "NOTE: " << s.components_note << "\n";
  } else {
    s.error = absl::StrCat("probing for kustomize components failed unexpectedly: ", probe.err);
    return s;
  }

  std::vector<std::pair<std::string, fs::path>> dirs;
  for (const auto& e : fs::directory_iterator(s.root / "overlays")) {
    if (e.is_directory()) dirs.emplace_back(absl::StrCat("overlays/", e.path().filename().string()), e.path());
  }
  std::sort(dirs.begin(), dirs.end());
  dirs.emplace_back("submit", s.root / "submit");
  if (s.components) {
    dirs.emplace_back("cpu+tls", Combine(s, "cpu+tls", "overlays/cpu", {"tls"}));
    dirs.emplace_back("gpu+tls", Combine(s, "gpu+tls", "overlays/gpu", {"tls"}));
    dirs.emplace_back("submit+tls", Combine(s, "submit+tls", "submit", {"tls"}));
    dirs.emplace_back("cpu+shared-storage+podmonitor",
                      Combine(s, "cpu+shared-storage+podmonitor", "overlays/cpu", {"shared-storage", "podmonitor"}));
    dirs.emplace_back(
        "gpu+tls+shared-storage+podmonitor",
        Combine(s, "gpu+tls+shared-storage+podmonitor", "overlays/gpu", {"tls", "shared-storage", "podmonitor"}));
    dirs.emplace_back("gpu+tls+nccl-secondary-network",
                      Combine(s, "gpu+tls+nccl-secondary-network", "overlays/gpu", {"tls", "nccl-secondary-network"}));
  }
  for (const auto& [name, dir] : dirs) {
    s.renders.push_back(RenderDir(s, name, dir));
    std::cout << "rendered " << name << ": "
              << (s.renders.back().ok ? absl::StrCat(s.renders.back().docs.size(), " objects") : "FAILED") << "\n";
  }
  return s;
}

const World& S() {
  static const World* setup = new World(MakeWorld());
  return *setup;
}

#define REQUIRE_SETUP()                    \
  const World& s = S();                    \
  ASSERT_TRUE(s.error.empty()) << s.error; \
  do {                                     \
  } while (0)

#define REQUIRE_COMPONENTS()                              \
  do {                                                    \
    if (!s.components) GTEST_SKIP() << s.components_note; \
  } while (0)

const Render* Find(const World& s, const std::string& name) {
  for (const Render& r : s.renders) {
    if (r.name == name) return &r;
  }
  return nullptr;
}

std::vector<Container> Containers(const World& s, const Render& r) {
  std::vector<Container> out;
  for (const YAML::Node& d : r.docs) {
    if (!IsWorkload(d)) continue;
    const YAML::Node pod = PodTemplate(d)["spec"];
    for (const char* field : {"initContainers", "containers"}) {
      for (const YAML::Node& c : pod[field]) {
        Container k;
        k.where = absl::StrCat(r.name, ": ", Kind(d), "/", Name(d), " container ", Str(c["name"]));
        k.doc = d;
        k.pod = pod;
        k.c = c;
        const std::vector<std::string> command = Strings(c["command"]);
        if (!command.empty()) k.binary = Basename(command[0]);
        k.args.assign(command.empty() ? command.end() : command.begin() + 1, command.end());
        for (const std::string& a : Strings(c["args"])) k.args.push_back(a);
        auto h = s.help.find(k.binary);
        if (h != s.help.end()) k.parsed = ParseArgs(k.args, h->second, k.binary);
        out.push_back(std::move(k));
      }
    }
  }
  return out;
}

std::vector<Container> OfBinary(const std::vector<Container>& cs, const std::string& binary) {
  std::vector<Container> out;
  for (const Container& c : cs) {
    if (c.binary == binary) out.push_back(c);
  }
  return out;
}

std::vector<const Render*> Rendered(const World& s) {
  std::vector<const Render*> out;
  for (const Render& r : s.renders) {
    if (r.ok) out.push_back(&r);
  }
  return out;
}

// ---------------------------------------------------------------------------

TEST(Manifests, EveryKustomizationRenders) {
  REQUIRE_SETUP();
  for (const char* required : {"overlays/cpu", "overlays/gpu", "submit"}) {
    EXPECT_NE(Find(s, required), nullptr) << required << " is missing";
  }
  for (const Render& r : s.renders) {
    EXPECT_TRUE(r.ok) << r.name << " with " << s.kubectl << ": " << r.error;
  }
  // The base renders on its own too (an overlay of someone else's may use it).
  const Render base = RenderDir(s, "base", s.root / "base");
  EXPECT_TRUE(base.ok) << base.error;
}

TEST(Manifests, DefaultBuildsHaveOnlyBuiltInKinds) {
  REQUIRE_SETUP();
  // A PodMonitor (or any CRD) in the default build would be rejected by a
  // cluster without prometheus-operator.
  static const std::set<std::string> builtin = {"v1", "apps/v1", "batch/v1", "policy/v1", "networking.k8s.io/v1"};
  for (const Render* r : Rendered(s)) {
    if (absl::StrContains(r->name, "podmonitor")) continue;
    for (const YAML::Node& d : r->docs) {
      EXPECT_TRUE(builtin.count(Str(d["apiVersion"])))
          << r->name << ": " << Kind(d) << "/" << Name(d) << " is " << Str(d["apiVersion"]);
    }
  }
}

TEST(Manifests, EveryContainerIsProbedLimitedAndNonRoot) {
  REQUIRE_SETUP();
  int checked = 0;
  for (const Render* r : Rendered(s)) {
    for (const Container& k : Containers(s, *r)) {
      ++checked;
      const YAML::Node& c = k.c;
      // A Job's pod runs to completion and serves nothing: no probes.
      if (Kind(k.doc) != "Job") {
        for (const char* probe : {"readinessProbe", "livenessProbe"}) {
          EXPECT_TRUE(c[probe].IsDefined()) << k.where << " has no " << probe;
        }
      }
      for (const char* kind : {"requests", "limits"}) {
        for (const char* res : {"cpu", "memory"}) {
          EXPECT_FALSE(Str(Get(c, {"resources", kind, res})).empty())
              << k.where << " has no resources." << kind << "." << res;
        }
      }
      // A worker offers ranks its memory limit (less a tenth): a request
      // below it would not guarantee what the coordinator places there.
      if (k.binary == kWorker) {
        EXPECT_EQ(Str(Get(c, {"resources", "requests", "memory"})), Str(Get(c, {"resources", "limits", "memory"})))
            << k.where << ": a worker's memory request must equal its limit";
      }
      const YAML::Node pod_sc = Get(k.pod, {"securityContext"});
      const YAML::Node sc = Get(c, {"securityContext"});
      auto either = [&](const char* field) { return sc[field].IsDefined() ? Str(sc[field]) : Str(pod_sc[field]); };
      EXPECT_EQ(either("runAsNonRoot"), "true") << k.where;
      EXPECT_EQ(either("runAsUser"), "10001") << k.where << ": the images' colod user";
      const std::string seccomp = sc["seccompProfile"].IsDefined() ? Str(Get(sc, {"seccompProfile", "type"}))
                                                                   : Str(Get(pod_sc, {"seccompProfile", "type"}));
      EXPECT_EQ(seccomp, "RuntimeDefault") << k.where;
      EXPECT_EQ(Str(sc["allowPrivilegeEscalation"]), "false") << k.where;
      EXPECT_EQ(Str(sc["readOnlyRootFilesystem"]), "true") << k.where;
      const std::vector<std::string> drop = Strings(Get(sc, {"capabilities", "drop"}));
      EXPECT_TRUE(Contains(drop, "ALL")) << k.where << " does not drop ALL capabilities";
      EXPECT_TRUE(Strings(Get(sc, {"capabilities", "add"})).empty()) << k.where << " adds capabilities";
      // With a read-only root, /tmp must be a volume.
      auto tmp = k.VolumeFor("/tmp/x");
      EXPECT_TRUE(tmp.has_value() && Str(tmp->second["mountPath"]) == "/tmp") << k.where << " has no writable /tmp";
    }
  }
  EXPECT_GT(checked, 0);
}

// The checks of one probe: one handler; its port on the container; the named
// service for readiness, "" for liveness; over TLS an exec probe with the
// daemon's own certificate files.
void CheckProbe(const World& s, const Container& k, const char* which, const std::string& service) {
  const YAML::Node probe = k.c[which];
  if (!probe.IsDefined()) return;  // reported elsewhere
  const std::string where = absl::StrCat(k.where, " ", which);
  int handlers = 0;
  for (const char* h : {"exec", "grpc", "httpGet", "tcpSocket"}) handlers += probe[h].IsDefined() ? 1 : 0;
  EXPECT_EQ(handlers, 1) << where << " must have exactly one handler (a patch that adds exec must remove grpc)";
  const bool tls = k.parsed.Flag("tls-cert").has_value();
  if (probe["grpc"].IsDefined()) {
    EXPECT_FALSE(tls) << where << ": Kubernetes' gRPC probe cannot speak TLS, and this daemon serves TLS";
    EXPECT_TRUE(k.HasPort(Get(probe, {"grpc", "port"}).as<int>(-1)))
        << where << ": port " << Str(Get(probe, {"grpc", "port"})) << " is not a containerPort";
    EXPECT_EQ(Str(Get(probe, {"grpc", "service"})), service) << where;
  }
  for (const char* h : {"httpGet", "tcpSocket"}) {
    if (probe[h].IsDefined()) {
      EXPECT_TRUE(k.HasPortRef(Str(Get(probe, {h, "port"}))))
          << where << ": port " << Str(Get(probe, {h, "port"})) << " not found";
    }
  }
  if (probe["exec"].IsDefined()) {
    const std::vector<std::string> command = Strings(Get(probe, {"exec", "command"}));
    ASSERT_FALSE(command.empty()) << where;
    ASSERT_EQ(Basename(command[0]), kColoctl) << where << ": exec probes run `coloctl health`";
    const Help& help = s.help.at(kColoctl);
    const ParsedArgs p = ParseArgs(std::vector<std::string>(command.begin() + 1, command.end()), help, kColoctl);
    for (const std::string& e : p.errors) ADD_FAILURE() << where << ": " << e;
    ASSERT_EQ(p.positional.size(), 2u) << where
                                       << ": expected `coloctl health HOST:PORT`: " << absl::StrJoin(command, " ");
    EXPECT_EQ(p.positional[0], "health") << where;
    EXPECT_TRUE(absl::StrContains(help.text, "\n  health ")) << where << ": `coloctl --help` lists no `health` command";
    const std::string& addr = p.positional[1];
    const size_t colon = addr.rfind(':');
    ASSERT_NE(colon, std::string::npos) << where << ": " << addr;
    const std::string host = addr.substr(0, colon);
    EXPECT_TRUE(host == "127.0.0.1" || host == "localhost" || host == "[::1]") << where << ": probes the pod itself";
    int port = -1;
    EXPECT_TRUE(absl::SimpleAtoi(addr.substr(colon + 1), &port) && k.HasPort(port))
        << where << ": " << addr << " is not a containerPort";
    EXPECT_EQ(p.Flag("service").value_or(""), service) << where;
    for (const char* f : {"tls-ca", "tls-cert", "tls-key"}) {
      EXPECT_EQ(p.Flag(f), k.parsed.Flag(f)) << where << ": --" << f << " must be the daemon's own";
    }
    if (p.Flag("timeout").has_value() && probe["timeoutSeconds"].IsDefined()) {
      EXPECT_LT(DurationSeconds(*p.Flag("timeout")).value_or(1e9), probe["timeoutSeconds"].as<double>())
          << where << ": coloctl's --timeout must end before the probe's timeoutSeconds";
    }
  }
}

TEST(Manifests, ProbesUseTheHealthServices) {
  REQUIRE_SETUP();
  int daemons = 0;
  for (const Render* r : Rendered(s)) {
    for (const Container& k : Containers(s, *r)) {
      std::string ready;
      if (k.binary == kCoordinator) ready = "colod.v1.CoordinatorService";
      if (k.binary == kWorker) ready = "colod.v1.WorkerService";
      if (ready.empty()) continue;
      ++daemons;
      CheckProbe(s, k, "readinessProbe", ready);
      CheckProbe(s, k, "livenessProbe", "");
      if (k.c["startupProbe"].IsDefined()) CheckProbe(s, k, "startupProbe", "");
    }
  }
  EXPECT_GT(daemons, 0);
}

TEST(Manifests, EveryFlagIsOneTheBinaryKnows) {
  REQUIRE_SETUP();
  for (const Render* r : Rendered(s)) {
    for (const Container& k : Containers(s, *r)) {
      ASSERT_TRUE(s.help.count(k.binary))
          << k.where << ": command " << absl::StrJoin(Strings(k.c["command"]), " ")
          << " is none of colod-coordinator, colod-worker, coloctl (set `command:` explicitly; the image's "
             "entrypoint is not part of the manifest)";
      for (const std::string& e : k.parsed.errors) ADD_FAILURE() << k.where << ": " << e;
      if (k.binary == kColoctl) {
        ASSERT_FALSE(k.parsed.positional.empty()) << k.where << ": coloctl without a command";
        EXPECT_TRUE(absl::StrContains(s.help.at(kColoctl).text, absl::StrCat("\n  ", k.parsed.positional[0], " ")))
            << k.where << ": `coloctl --help` lists no command " << k.parsed.positional[0];
      } else {
        EXPECT_TRUE(k.parsed.positional.empty())
            << k.where << ": the daemons take no positional arguments: " << absl::StrJoin(k.parsed.positional, " ");
      }
    }
  }
}

TEST(Manifests, VariablesVolumesAndConfigMapsResolve) {
  REQUIRE_SETUP();
  for (const Render* r : Rendered(s)) {
    std::set<std::string> config_maps;
    for (const YAML::Node& d : r->OfKind("ConfigMap")) config_maps.insert(Name(d));
    for (const Container& k : Containers(s, *r)) {
      std::vector<std::string> defined;
      for (const YAML::Node& e : k.c["env"]) {
        const std::string name = Str(e["name"]);
        EXPECT_FALSE(e["value"].IsDefined() && e["valueFrom"].IsDefined())
            << k.where << ": env " << name << " has both value and valueFrom";
        // An env value may only use variables defined before it.
        for (const std::string& v : VarRefs(Str(e["value"]))) {
          EXPECT_TRUE(Contains(defined, v))
              << k.where << ": env " << name << " uses $(" << v << "), not defined before it";
        }
        defined.push_back(name);
      }
      // command and args may use any of them.
      std::vector<std::string> uses = k.args;
      for (const char* probe : {"readinessProbe", "livenessProbe", "startupProbe"}) {
        for (const std::string& a : Strings(Get(k.c, {probe, "exec", "command"}))) {
          // Exec probes are not expanded by Kubernetes: a $(VAR) there is literal.
          EXPECT_TRUE(VarRefs(a).empty())
              << k.where << " " << probe << ": $(...) is not expanded in exec probes: " << a;
        }
      }
      for (const std::string& a : uses) {
        for (const std::string& v : VarRefs(a)) {
          EXPECT_TRUE(Contains(defined, v))
              << k.where << ": argument " << a << " uses $(" << v << "), which no env entry defines";
        }
      }
      for (const YAML::Node& m : k.c["volumeMounts"]) {
        const auto v = k.VolumeFor(Str(m["mountPath"]));
        EXPECT_TRUE(v.has_value() && Str(v->second["name"]) == Str(m["name"]))
            << k.where << ": volumeMount " << Str(m["name"]) << " has no volume";
      }
      for (const YAML::Node& v : k.pod["volumes"]) {
        if (v["configMap"].IsDefined()) {
          EXPECT_TRUE(config_maps.count(Str(Get(v, {"configMap", "name"}))))
              << k.where << ": ConfigMap " << Str(Get(v, {"configMap", "name"})) << " is not part of " << r->name;
        }
      }
      // Every file a flag names is on a mounted volume (the root is read-only
      // and the image has none of them).
      for (const auto& [flag, value] : k.parsed.flags) {
        if (!absl::EndsWith(flag, "-file") && !absl::StartsWith(flag, "tls-")) continue;
        const auto v = k.VolumeFor(value);
        ASSERT_TRUE(v.has_value()) << k.where << ": --" << flag << "=" << value << " is on no mounted volume";
        if (absl::EndsWith(flag, "token-file") || absl::StartsWith(flag, "tls-")) {
          EXPECT_TRUE(v->first["secret"].IsDefined()) << k.where << ": --" << flag << " must come from a Secret";
        }
      }
    }
  }
}

TEST(Manifests, ServicesAnnotationsAndPolicyPortsExist) {
  REQUIRE_SETUP();
  for (const Render* r : Rendered(s)) {
    const std::vector<Container> cs = Containers(s, *r);
    auto selected = [&](const std::function<bool(const std::map<std::string, std::string>&)>& match) {
      std::vector<Container> out;
      for (const Container& k : cs) {
        if (match(k.PodLabels())) out.push_back(k);
      }
      return out;
    };
    for (const YAML::Node& svc : r->OfKind("Service")) {
      const auto selector = StringMap(Get(svc, {"spec", "selector"}));
      const std::vector<Container> pods = selected([&](const auto& l) { return LabelsMatch(selector, l); });
      ASSERT_FALSE(selector.empty() || pods.empty()) << r->name << ": Service " << Name(svc) << " selects no pod";
      for (const YAML::Node& p : Get(svc, {"spec", "ports"})) {
        const std::string target = p["targetPort"].IsDefined() ? Str(p["targetPort"]) : Str(p["port"]);
        EXPECT_TRUE(std::any_of(pods.begin(), pods.end(), [&](const Container& k) { return k.HasPortRef(target); }))
            << r->name << ": Service " << Name(svc) << " port " << Str(p["name"]) << " targets " << target
            << ", which its pods do not have";
      }
    }
    for (const Container& k : cs) {
      const auto annotations = StringMap(Get(PodTemplate(k.doc), {"metadata", "annotations"}));
      auto scrape = annotations.find("prometheus.io/scrape");
      if (scrape == annotations.end() || scrape->second != "true") continue;
      EXPECT_TRUE(k.HasPortRef(annotations.count("prometheus.io/port") ? annotations.at("prometheus.io/port") : ""))
          << k.where << ": prometheus.io/port is not a containerPort";
      if (k.binary == kCoordinator || k.binary == kWorker) {
        EXPECT_EQ(std::to_string(k.PortNumber("metrics")),
                  annotations.count("prometheus.io/port") ? annotations.at("prometheus.io/port") : "")
            << k.where << ": the scrape annotation must name the metrics port";
      }
    }
    for (const YAML::Node& np : r->OfKind("NetworkPolicy")) {
      const std::vector<Container> pods = selected([&](const auto& l) {
        return SelectorMatches(Get(np, {"spec", "podSelector"}), l);
      });
      ASSERT_FALSE(pods.empty()) << r->name << ": NetworkPolicy " << Name(np) << " selects no pod";
      for (const YAML::Node& rule : Get(np, {"spec", "ingress"})) {
        for (const YAML::Node& p : rule["ports"]) {
          EXPECT_TRUE(
              std::all_of(pods.begin(), pods.end(), [&](const Container& k) { return k.HasPortRef(Str(p["port"])); }))
              << r->name << ": NetworkPolicy " << Name(np) << " names port " << Str(p["port"]) << " its pods lack";
        }
      }
    }
    for (const YAML::Node& pm : r->OfKind("PodMonitor")) {
      const std::vector<Container> pods = selected([&](const auto& l) {
        return SelectorMatches(Get(pm, {"spec", "selector"}), l);
      });
      EXPECT_EQ(OfBinary(pods, kCoordinator).size(), 1u) << r->name << ": PodMonitor must scrape the coordinator";
      EXPECT_EQ(OfBinary(pods, kWorker).size(), 1u) << r->name << ": PodMonitor must scrape the workers";
      for (const YAML::Node& ep : Get(pm, {"spec", "podMetricsEndpoints"})) {
        // The alerts (ColodCoordinatorDown, ...) and the dashboard select on
        // `component`: the endpoint must set it from the pod's component label.
        bool sets_component = false;
        for (const YAML::Node& rl : ep["relabelings"]) {
          const YAML::Node src = rl["sourceLabels"];
          if (Str(rl["targetLabel"]) == "component" && src.IsSequence() && src.size() == 1 &&
              Str(src[0]) == "__meta_kubernetes_pod_label_app_kubernetes_io_component") {
            sets_component = true;
          }
        }
        EXPECT_TRUE(sets_component) << r->name << ": PodMonitor endpoint " << Str(ep["port"])
                                    << " does not set the `component` label the alerts select on";
        for (const Container& k : pods) {
          EXPECT_TRUE(k.HasPortName(Str(ep["port"])))
              << r->name << ": PodMonitor port " << Str(ep["port"]) << " not on " << k.where;
        }
      }
    }
  }
}

// Whether the NetworkPolicies of `r` let a pod with `from` labels in a
// namespace with `from_ns` labels (`same_ns`: the policies' namespace) reach
// `to` on `port` (a container port number).
bool Allowed(const Render& r, const std::map<std::string, std::string>& from,
             const std::map<std::string, std::string>& from_ns, bool same_ns, const Container& to, int port) {
  bool isolated = false;
  for (const YAML::Node& np : r.OfKind("NetworkPolicy")) {
    if (!SelectorMatches(Get(np, {"spec", "podSelector"}), to.PodLabels())) continue;
    isolated = true;
    for (const YAML::Node& rule : Get(np, {"spec", "ingress"})) {
      bool port_ok = !rule["ports"].IsDefined() || rule["ports"].size() == 0;
      for (const YAML::Node& p : rule["ports"]) {
        const std::string ref = Str(p["port"]);
        int n;
        if (absl::SimpleAtoi(ref, &n) ? n == port : to.PortNumber(ref) == port) port_ok = true;
      }
      bool peer_ok = !rule["from"].IsDefined() || rule["from"].size() == 0;
      for (const YAML::Node& peer : rule["from"]) {
        const bool has_ns = peer["namespaceSelector"].IsDefined(), has_pod = peer["podSelector"].IsDefined();
        const bool ns_ok = has_ns ? SelectorMatches(peer["namespaceSelector"], from_ns) : same_ns;
        const bool pod_ok = has_pod ? SelectorMatches(peer["podSelector"], from) : true;
        if ((has_ns || has_pod) && ns_ok && pod_ok) peer_ok = true;
      }
      if (port_ok && peer_ok) return true;
    }
  }
  return !isolated;
}

TEST(Manifests, NetworkPolicyLetsThroughWhatColodNeedsAndNoMore) {
  REQUIRE_SETUP();
  for (const Render* r : Rendered(s)) {
    const std::vector<Container> cs = Containers(s, *r);
    const std::vector<Container> coordinators = OfBinary(cs, kCoordinator), workers = OfBinary(cs, kWorker);
    if (coordinators.empty() || workers.empty()) continue;
    const Container& c = coordinators[0];
    const Container& w = workers[0];
    const std::map<std::string, std::string> ns = {{"kubernetes.io/metadata.name", "colod"}};
    const std::map<std::string, std::string> monitoring = {{"kubernetes.io/metadata.name", "monitoring"}};
    const std::map<std::string, std::string> other_ns = {{"kubernetes.io/metadata.name", "elsewhere"}};
    const std::map<std::string, std::string> client = {{"colod.io/client", "true"}};
    const std::map<std::string, std::string> stranger = {{"app", "something-else"}};
    const std::map<std::string, std::string> prometheus = {{"app.kubernetes.io/name", "prometheus"}};
    const int cgrpc = c.PortNumber("grpc"), cmetrics = c.PortNumber("metrics");
    const int wgrpc = w.PortNumber("grpc"), wmetrics = w.PortNumber("metrics");
    const std::string& n = r->name;
    EXPECT_TRUE(Allowed(*r, w.PodLabels(), ns, true, c, cgrpc)) << n << ": workers -> coordinator grpc";
    EXPECT_TRUE(Allowed(*r, client, ns, true, c, cgrpc)) << n << ": clients -> coordinator grpc";
    EXPECT_FALSE(Allowed(*r, stranger, ns, true, c, cgrpc)) << n << ": any pod -> coordinator grpc";
    EXPECT_FALSE(Allowed(*r, w.PodLabels(), ns, true, c, 40000)) << n << ": workers -> coordinator, other ports";
    EXPECT_TRUE(Allowed(*r, c.PodLabels(), ns, true, w, wgrpc)) << n << ": coordinator -> worker grpc";
    EXPECT_FALSE(Allowed(*r, c.PodLabels(), ns, true, w, 40000)) << n << ": coordinator -> worker, other ports";
    EXPECT_TRUE(Allowed(*r, w.PodLabels(), ns, true, w, 40000)) << n << ": worker -> worker, Gloo's ephemeral ports";
    EXPECT_TRUE(Allowed(*r, w.PodLabels(), ns, true, w, wgrpc)) << n << ": worker -> worker grpc";
    EXPECT_FALSE(Allowed(*r, stranger, ns, true, w, 40000)) << n << ": any pod -> worker";
    EXPECT_FALSE(Allowed(*r, client, ns, true, w, wgrpc)) << n << ": clients -> worker";
    EXPECT_TRUE(Allowed(*r, stranger, monitoring, false, c, cmetrics)) << n << ": monitoring namespace -> metrics";
    EXPECT_TRUE(Allowed(*r, stranger, monitoring, false, w, wmetrics)) << n << ": monitoring namespace -> metrics";
    EXPECT_TRUE(Allowed(*r, prometheus, other_ns, false, w, wmetrics)) << n << ": Prometheus pods -> metrics";
    EXPECT_FALSE(Allowed(*r, stranger, monitoring, false, c, cgrpc)) << n << ": monitoring -> grpc";
    EXPECT_FALSE(Allowed(*r, stranger, other_ns, false, c, cmetrics)) << n << ": other namespaces -> metrics";
    EXPECT_FALSE(Allowed(*r, w.PodLabels(), other_ns, false, c, cgrpc)) << n << ": workers of another namespace";
  }
}

TEST(Manifests, CoordinatorKeepsItsStateOnAClaim) {
  REQUIRE_SETUP();
  int seen = 0;
  for (const Render* r : Rendered(s)) {
    for (const Container& k : OfBinary(Containers(s, *r), kCoordinator)) {
      ++seen;
      EXPECT_EQ(Kind(k.doc), "StatefulSet") << k.where;
      EXPECT_EQ(Str(Get(k.doc, {"spec", "replicas"})), "1") << k.where << ": one coordinator (its data dir is locked)";
      const std::string data_dir = k.parsed.Flag("data-dir").value_or("");
      ASSERT_FALSE(data_dir.empty()) << k.where << ": --data-dir is required";
      const auto v = k.VolumeFor(data_dir);
      ASSERT_TRUE(v.has_value()) << k.where << ": --data-dir " << data_dir << " is not mounted";
      EXPECT_TRUE(v->first["persistentVolumeClaim"].IsDefined()) << k.where << ": --data-dir must be on a claim";
      EXPECT_EQ(Str(v->second["mountPath"]), data_dir) << k.where;
      EXPECT_NE(Str(Get(k.pod, {"securityContext", "fsGroup"})), "") << k.where << ": fsGroup makes the claim writable";
      const YAML::Node svc = r->Find("Service", Str(Get(k.doc, {"spec", "serviceName"})));
      ASSERT_TRUE(svc.IsDefined()) << k.where << ": serviceName names no Service";
      std::set<std::string> names;
      for (const YAML::Node& p : Get(svc, {"spec", "ports"})) names.insert(Str(p["name"]));
      EXPECT_EQ(names, (std::set<std::string>{"grpc", "metrics"})) << k.where;
      // --listen and --metrics-listen are the ports named grpc and metrics.
      for (const auto& [flag, port] :
           std::vector<std::pair<std::string, std::string>>{{"listen", "grpc"}, {"metrics-listen", "metrics"}}) {
        const std::string addr = k.parsed.Flag(flag).value_or(flag == "listen" ? "0.0.0.0:7070" : "0.0.0.0:9470");
        EXPECT_EQ(addr.substr(addr.rfind(':') + 1), std::to_string(k.PortNumber(port))) << k.where << " --" << flag;
        EXPECT_TRUE(absl::StartsWith(addr, "0.0.0.0:") || absl::StartsWith(addr, "[::]:"))
            << k.where << ": --" << flag << " must listen on the pod's address";
      }
    }
  }
  EXPECT_GT(seen, 0);
}

TEST(Manifests, WorkersRegisterWithTheCoordinatorAndAreReachable) {
  REQUIRE_SETUP();
  int seen = 0;
  for (const Render* r : Rendered(s)) {
    const std::vector<Container> cs = Containers(s, *r);
    for (const Container& k : OfBinary(cs, kWorker)) {
      ++seen;
      const YAML::Node& spec = k.doc["spec"];
      EXPECT_EQ(Kind(k.doc), "StatefulSet") << k.where;
      EXPECT_EQ(Str(spec["podManagementPolicy"]), "Parallel") << k.where;
      const YAML::Node headless = r->Find("Service", Str(spec["serviceName"]));
      ASSERT_TRUE(headless.IsDefined()) << k.where << ": serviceName names no Service";
      EXPECT_EQ(Str(Get(headless, {"spec", "clusterIP"})), "None") << k.where << ": the workers' Service is headless";
      EXPECT_TRUE(LabelsMatch(StringMap(Get(headless, {"spec", "selector"})), k.PodLabels())) << k.where;
      for (const auto& [flag, port] :
           std::vector<std::pair<std::string, std::string>>{{"listen", "grpc"}, {"metrics-listen", "metrics"}}) {
        const std::string addr = k.parsed.Flag(flag).value_or(flag == "listen" ? "0.0.0.0:7071" : "0.0.0.0:9471");
        EXPECT_EQ(addr.substr(addr.rfind(':') + 1), std::to_string(k.PortNumber(port))) << k.where << " --" << flag;
      }

      // --coordinator is the coordinator Service's name and port.
      const std::string coordinator = k.parsed.Flag("coordinator").value_or("");
      const size_t colon = coordinator.rfind(':');
      ASSERT_NE(colon, std::string::npos) << k.where << ": --coordinator=" << coordinator;
      const std::string svc_name = coordinator.substr(0, coordinator.find('.') < colon ? coordinator.find('.') : colon);
      const YAML::Node svc = r->Find("Service", svc_name);
      ASSERT_TRUE(svc.IsDefined()) << k.where << ": --coordinator " << coordinator << " names no Service";
      const std::vector<Container> coordinators = OfBinary(cs, kCoordinator);
      ASSERT_EQ(coordinators.size(), 1u) << r->name;
      EXPECT_TRUE(LabelsMatch(StringMap(Get(svc, {"spec", "selector"})), coordinators[0].PodLabels()))
          << k.where << ": " << svc_name << " does not select the coordinator";
      bool port_ok = false;
      for (const YAML::Node& p : Get(svc, {"spec", "ports"})) {
        if (Str(p["port"]) == coordinator.substr(colon + 1)) {
          const std::string target = p["targetPort"].IsDefined() ? Str(p["targetPort"]) : Str(p["port"]);
          int n;
          port_ok = (absl::SimpleAtoi(target, &n) ? n : coordinators[0].PortNumber(target)) ==
                    coordinators[0].PortNumber("grpc");
        }
      }
      EXPECT_TRUE(port_ok) << k.where << ": " << coordinator << " does not lead to the coordinator's grpc port";

      // --advertise-host: the pod IP, or (TLS) the pod's DNS name under the
      // headless Service, which a certificate can name.
      const std::string advertise = k.parsed.Flag("advertise-host").value_or("");
      auto field_of = [&](const std::string& var) {
        return Str(Get(k.Env(var), {"valueFrom", "fieldRef", "fieldPath"}));
      };
      const std::vector<std::string> refs = VarRefs(advertise);
      if (r->tls) {
        ASSERT_EQ(refs.size(), 2u) << k.where
                                   << ": with TLS, advertise $(POD_NAME).SERVICE.$(NAMESPACE).svc: " << advertise;
        EXPECT_EQ(advertise, absl::StrCat("$(", refs[0], ").", Str(spec["serviceName"]), ".$(", refs[1], ").svc"))
            << k.where;
        EXPECT_EQ(field_of(refs[0]), "metadata.name") << k.where;
        EXPECT_EQ(field_of(refs[1]), "metadata.namespace") << k.where;
        EXPECT_EQ(Str(Get(headless, {"spec", "publishNotReadyAddresses"})), "true")
            << k.where << ": the name must resolve before the worker is ready";
      } else {
        ASSERT_EQ(refs.size(), 1u) << k.where << ": --advertise-host=" << advertise;
        EXPECT_EQ(advertise, absl::StrCat("$(", refs[0], ")")) << k.where;
        EXPECT_EQ(field_of(refs[0]), "status.podIP") << k.where;
      }

      // --labels carries the node's name.
      bool node_label = false;
      for (const std::string& v : VarRefs(k.parsed.Flag("labels").value_or(""))) {
        node_label |= field_of(v) == "spec.nodeName";
      }
      EXPECT_TRUE(node_label) << k.where << ": --labels must carry spec.nodeName";

      // A grace period for a drain (a step and a checkpoint's save after
      // SIGTERM), with half a minute for the save and the exit after it (the
      // rank is aborted then: no collective waits out --comm-timeout).
      const double drain_timeout = DurationSeconds(k.parsed.Flag("drain-timeout").value_or("1m")).value_or(-1);
      ASSERT_GE(drain_timeout, 0) << k.where << ": --drain-timeout does not parse";
      EXPECT_GE(k.pod["terminationGracePeriodSeconds"].as<double>(30), drain_timeout + 30)
          << k.where << ": terminationGracePeriodSeconds must cover --drain-timeout and 30 s more";

      // Scratch space on a volume.
      const std::string work_dir = k.parsed.Flag("work-dir").value_or("");
      ASSERT_FALSE(work_dir.empty()) << k.where << ": --work-dir (the root file system is read-only)";
      const auto v = k.VolumeFor(work_dir);
      EXPECT_TRUE(v.has_value() && v->first["emptyDir"].IsDefined()) << k.where << ": --work-dir must be an emptyDir";

      // Jobs name paths only under --allow-path roots, each on a volume
      // (the worker refuses to start with a root that does not exist).
      int roots = 0;
      for (const auto& [name, value] : k.parsed.flags) {
        if (name != "allow-path") continue;
        for (absl::string_view root : absl::StrSplit(value, ',')) {
          ++roots;
          EXPECT_TRUE(k.VolumeFor(std::string(root)).has_value())
              << k.where << ": --allow-path " << root << " is on no volume";
        }
      }
      EXPECT_GE(roots, 1) << k.where << ": no --allow-path: jobs could read and write any path";
      // No root lies in the work dir, which the worker lets no job name: it
      // would allow nothing.
      for (const auto& [name, value] : k.parsed.flags) {
        if (name != "allow-path") continue;
        for (absl::string_view root : absl::StrSplit(value, ',')) {
          EXPECT_FALSE(root == work_dir || absl::StartsWith(root, work_dir + "/"))
              << k.where << ": --allow-path " << root << " is in --work-dir " << work_dir;
        }
      }

      // A PodDisruptionBudget covers the workers.
      bool pdb = false;
      for (const YAML::Node& b : r->OfKind("PodDisruptionBudget")) {
        pdb |= SelectorMatches(Get(b, {"spec", "selector"}), k.PodLabels()) &&
               (Get(b, {"spec", "maxUnavailable"}).IsDefined() || Get(b, {"spec", "minAvailable"}).IsDefined());
      }
      EXPECT_TRUE(pdb) << k.where << ": no PodDisruptionBudget";
    }
  }
  EXPECT_GT(seen, 0);
}

// Every container authenticates, each with its role's token: the workers
// with the workers' (the coordinator's --worker-token-file) and no Secret
// that holds the clients' token, clients (the submit Job) with the clients'.
TEST(Manifests, EveryColodContainerAuthenticatesWithItsRolesToken) {
  REQUIRE_SETUP();
  int workers = 0, coordinators = 0;
  for (const Render* r : Rendered(s)) {
    for (const Container& k : Containers(s, *r)) {
      const auto token = k.parsed.Flag("auth-token-file");
      ASSERT_TRUE(token.has_value()) << k.where << ": no --auth-token-file";
      const auto v = k.VolumeFor(*token);
      ASSERT_TRUE(v.has_value()) << k.where;
      const std::string secret = Str(Get(v->first, {"secret", "secretName"}));
      EXPECT_EQ(secret, k.binary == kWorker ? "colod-worker-auth" : "colod-auth") << k.where;
      if (k.binary == kWorker) {
        ++workers;
        for (const YAML::Node& vol : k.pod["volumes"]) {
          EXPECT_NE(Str(Get(vol, {"secret", "secretName"})), "colod-auth")
              << k.where << ": a worker pod mounts the clients' token";
        }
      }
      const auto worker_token = k.parsed.Flag("worker-token-file");
      EXPECT_EQ(worker_token.has_value(), k.binary == kCoordinator) << k.where;
      if (k.binary == kCoordinator && worker_token.has_value()) {
        ++coordinators;
        const auto w = k.VolumeFor(*worker_token);
        ASSERT_TRUE(w.has_value()) << k.where;
        EXPECT_EQ(Str(Get(w->first, {"secret", "secretName"})), "colod-worker-auth") << k.where;
      }
    }
  }
  EXPECT_GT(workers, 0);
  EXPECT_GT(coordinators, 0);
}

TEST(Manifests, CpuAndGpuOverlaysChooseTheirDevice) {
  REQUIRE_SETUP();
  int cpu = 0, gpu = 0;
  for (const Render* r : Rendered(s)) {
    for (const Container& k : Containers(s, *r)) {
      if (k.binary == kCoordinator) {
        EXPECT_EQ(ImageName(Str(k.c["image"])), "colod") << k.where << ": the coordinator needs no CUDA image";
        EXPECT_FALSE(Get(k.c, {"resources", "limits", "nvidia.com/gpu"}).IsDefined()) << k.where;
      }
      if (k.binary != kWorker) continue;
      EXPECT_EQ(k.parsed.Count("device"), r->cpu || r->gpu ? 1 : 0) << k.where << ": --device once";
      const std::string device = k.parsed.Flag("device").value_or("");
      const YAML::Node gpus = Get(k.c, {"resources", "limits", "nvidia.com/gpu"});
      std::vector<std::string> env;
      for (const YAML::Node& e : k.c["env"]) env.push_back(Str(e["name"]));
      auto shm = k.VolumeFor("/dev/shm/x");
      if (r->gpu) {
        ++gpu;
        EXPECT_EQ(device, "cuda") << k.where;
        EXPECT_EQ(Str(gpus), "1") << k.where << ": one GPU per worker";
        EXPECT_EQ(ImageName(Str(k.c["image"])), "colod-cuda") << k.where;
        ASSERT_TRUE(shm.has_value() && Str(shm->second["mountPath"]) == "/dev/shm") << k.where << ": no /dev/shm";
        EXPECT_EQ(Str(Get(shm->first, {"emptyDir", "medium"})), "Memory")
            << k.where << ": /dev/shm must be memory-backed";
        for (const std::string& e : env) {
          EXPECT_FALSE(absl::StartsWith(e, "OPENBLAS_") || absl::StartsWith(e, "OMP_"))
              << k.where << ": CPU-only " << e;
        }
        const YAML::Node requested = Get(k.c, {"resources", "requests", "nvidia.com/gpu"});
        if (requested.IsDefined()) {
          EXPECT_EQ(Str(requested), Str(gpus)) << k.where << ": an extended resource's request must equal its limit";
        }
        // NCCL across nodes: its sockets on an interface every peer reaches,
        // the pod network's, or the secondary network Multus attaches.
        std::vector<std::string> ifname;
        for (const YAML::Node& e : k.c["env"]) {
          if (Str(e["name"]) == "NCCL_SOCKET_IFNAME") ifname.push_back(Str(e["value"]));
        }
        ASSERT_EQ(ifname.size(), 1u) << k.where << ": NCCL_SOCKET_IFNAME once";
        const std::string networks =
            Str(Get(k.doc, {"spec", "template", "metadata", "annotations", "k8s.v1.cni.cncf.io/networks"}));
        if (r->nccl_net) {
          EXPECT_EQ(ifname[0], "net1") << k.where;
          EXPECT_EQ(networks, "colod-nccl") << k.where << ": net1 comes from Multus";
        } else {
          EXPECT_EQ(ifname[0], "eth0") << k.where;
          EXPECT_EQ(networks, "") << k.where;
        }
        EXPECT_FALSE(Get(k.pod, {"hostNetwork"}).IsDefined())
            << k.where << ": one pod per GPU needs a network namespace each (ports)";
      } else if (r->cpu) {
        ++cpu;
        EXPECT_EQ(device, "cpu") << k.where;
        EXPECT_FALSE(gpus.IsDefined()) << k.where;
        EXPECT_EQ(ImageName(Str(k.c["image"])), "colod") << k.where;
        EXPECT_FALSE(shm.has_value()) << k.where << ": /dev/shm volume is a GPU setting";
        EXPECT_TRUE(Contains(env, "OPENBLAS_NUM_THREADS"))
            << k.where << ": OpenBLAS must not start a thread per node core";
      }
    }
  }
  EXPECT_GT(cpu, 0);
  EXPECT_GT(gpu, 0);
}

TEST(Manifests, SubmitJobSendsAJobSpecTheCoordinatorAccepts) {
  REQUIRE_SETUP();
  const Render* cpu = Find(s, "overlays/cpu");
  ASSERT_TRUE(cpu != nullptr && cpu->ok);
  const std::vector<Container> workers = OfBinary(Containers(s, *cpu), kWorker);
  ASSERT_EQ(workers.size(), 1u);
  const int replicas = Get(workers[0].doc, {"spec", "replicas"}).as<int>(1);
  int seen = 0;
  for (const Render* r : Rendered(s)) {
    for (const Container& k : OfBinary(Containers(s, *r), kColoctl)) {
      ++seen;
      EXPECT_EQ(Kind(k.doc), "Job") << k.where;
      EXPECT_EQ(Str(k.pod["restartPolicy"]), "Never") << k.where;
      ASSERT_FALSE(k.parsed.positional.empty());
      EXPECT_EQ(k.parsed.positional[0], "submit") << k.where;
      EXPECT_EQ(k.parsed.Flag("coordinator"), workers[0].parsed.Flag("coordinator"))
          << k.where << ": submits to the coordinator the workers register with";
      EXPECT_EQ(k.parsed.Flag("watch"), "true") << k.where << ": --watch (the Job ends with the colod job)";
      const std::string request_id = k.parsed.Flag("request-id").value_or("");
      EXPECT_FALSE(request_id.empty()) << k.where << ": --request-id makes a retried pod follow the same job";
      EXPECT_TRUE(absl::StrContains(Str(Get(PodTemplate(k.doc), {"metadata", "labels", "colod.io/client"})), "true"))
          << k.where << ": the NetworkPolicy admits clients labelled colod.io/client";
      const std::string job_file = k.parsed.Flag("job-file").value_or("");
      const auto v = k.VolumeFor(job_file);
      ASSERT_TRUE(v.has_value() && v->first["configMap"].IsDefined()) << k.where << ": --job-file from a ConfigMap";
      const YAML::Node cm = r->Find("ConfigMap", Str(Get(v->first, {"configMap", "name"})));
      ASSERT_TRUE(cm.IsDefined()) << k.where;
      const std::string key = job_file.substr(Str(v->second["mountPath"]).size() + 1);
      ASSERT_TRUE(Get(cm, {"data", key}).IsDefined()) << k.where << ": ConfigMap has no key " << key;
      EXPECT_TRUE(absl::EndsWith(key, ".yaml") || absl::EndsWith(key, ".yml")) << "coloctl reads YAML by extension";
      auto spec = ParseJobSpec(Str(Get(cm, {"data", key})), /*yaml=*/true, key);
      ASSERT_TRUE(spec.ok()) << k.where << ": " << spec.status();
      EXPECT_TRUE(ValidateJobSpec(*spec).ok()) << k.where << ": " << ValidateJobSpec(*spec);
      EXPECT_LE(spec->shard().tensor_parallel_size() * std::max(1, spec->shard().data_parallel_size()), replicas)
          << k.where << ": the example needs more ranks than the overlays have workers";
    }
  }
  EXPECT_GT(seen, 0);
}

// ---------------------------------------------------------------------------
// Components.

TEST(Components, TlsTurnsOnTlsEverywhere) {
  REQUIRE_SETUP();
  REQUIRE_COMPONENTS();
  int seen = 0;
  for (const Render* r : Rendered(s)) {
    if (!r->tls) continue;
    for (const Container& k : Containers(s, *r)) {
      ++seen;
      for (const char* f : {"tls-cert", "tls-key", "tls-ca"}) {
        const auto path = k.parsed.Flag(f);
        ASSERT_TRUE(path.has_value()) << k.where << ": no --" << f;
        const auto v = k.VolumeFor(*path);
        ASSERT_TRUE(v.has_value()) << k.where;
        EXPECT_EQ(Str(Get(v->first, {"secret", "secretName"})), "colod-tls") << k.where;
      }
      if (k.binary == kColoctl) continue;
      for (const char* probe : {"readinessProbe", "livenessProbe"}) {
        EXPECT_TRUE(Get(k.c, {probe, "exec"}).IsDefined())
            << k.where << " " << probe << " must be an exec probe under TLS";
      }
    }
  }
  EXPECT_GE(seen, 5);
  // Without the component nothing speaks TLS.
  for (const Render* r : Rendered(s)) {
    if (r->tls) continue;
    for (const Container& k : Containers(s, *r)) {
      EXPECT_FALSE(k.parsed.Flag("tls-cert").has_value() || k.parsed.Flag("tls-ca").has_value()) << k.where;
    }
  }
}

TEST(Components, SharedStorageAndPodMonitor) {
  REQUIRE_SETUP();
  REQUIRE_COMPONENTS();
  const Render* r = Find(s, "cpu+shared-storage+podmonitor");
  ASSERT_TRUE(r != nullptr && r->ok);
  EXPECT_EQ(r->OfKind("PodMonitor").size(), 1u);
  const YAML::Node pvc = r->Find("PersistentVolumeClaim", "colod-shared");
  ASSERT_TRUE(pvc.IsDefined());
  EXPECT_EQ(Strings(Get(pvc, {"spec", "accessModes"})), std::vector<std::string>{"ReadWriteMany"});
  const std::vector<Container> workers = OfBinary(Containers(s, *r), kWorker);
  ASSERT_EQ(workers.size(), 1u);
  // The example job's model and checkpoints are on the shared claim.
  const Render* submit = Find(s, "submit");
  ASSERT_TRUE(submit != nullptr && submit->ok);
  const std::vector<YAML::Node> cms = submit->OfKind("ConfigMap");
  ASSERT_EQ(cms.size(), 1u);
  auto spec = ParseJobSpec(Str(Get(cms[0], {"data", "job.yaml"})), true);
  ASSERT_TRUE(spec.ok()) << spec.status();
  // And under the workers' --allow-path roots, or the job fails
  // PERMISSION_DENIED (its data included).
  std::vector<std::string> roots;
  for (const auto& [name, value] : workers[0].parsed.flags) {
    if (name != "allow-path") continue;
    for (absl::string_view root : absl::StrSplit(value, ',')) roots.emplace_back(root);
  }
  for (const std::string& path : {spec->model().weights_path(), spec->train().data_path(),
                                  spec->train().checkpoint_dir(), spec->train().final_dir()}) {
    if (path.empty()) continue;
    const auto v = workers[0].VolumeFor(path);
    ASSERT_TRUE(v.has_value()) << path << " is on no worker volume";
    EXPECT_EQ(Str(Get(v->first, {"persistentVolumeClaim", "claimName"})), "colod-shared") << path;
    EXPECT_TRUE(std::any_of(roots.begin(), roots.end(), [&](const std::string& root) {
      return path == root || absl::StartsWith(path, root + "/");
    })) << path << " is under no --allow-path root of the workers (" << absl::StrJoin(roots, ", ") << ")";
  }
}

}  // namespace
}  // namespace colod
