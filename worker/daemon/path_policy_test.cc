// PathPolicy on a real directory tree: paths under a root, "..", symbolic
// links out of a root, sibling names, relative paths, outputs not written
// yet, and every path field of a job spec.
#include "worker/daemon/path_policy.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace colod {
namespace {

namespace fs = std::filesystem;

class PathPolicyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = fs::weakly_canonical(testing::TempPath("paths")).string();
    fs::remove_all(base_);
    for (const char* d : {"data", "data2", "ckpt", "outside"}) fs::create_directories(base_ + "/" + d);
    std::ofstream(base_ + "/data/corpus.bin") << "tokens";
    std::ofstream(base_ + "/outside/secret") << "secret";
    fs::create_symlink(base_ + "/outside", base_ + "/data/link");
    auto p = PathPolicy::Create({base_ + "/data", base_ + "/ckpt/"});
    ASSERT_TRUE(p.ok()) << p.status();
    policy_ = *p;
  }
  std::string base_;
  PathPolicy policy_;
};

TEST_F(PathPolicyTest, OnlyPathsUnderARootAreAllowed) {
  EXPECT_TRUE(policy_.Check("f", base_ + "/data/corpus.bin").ok());
  EXPECT_TRUE(policy_.Check("f", base_ + "/data").ok());
  EXPECT_TRUE(policy_.Check("f", base_ + "/ckpt/run-1/step-000010").ok());  // not written yet
  EXPECT_TRUE(policy_.Check("f", base_ + "/data/./sub/../corpus.bin").ok());
  for (const std::string& bad : {base_ + "/outside/secret", base_ + "/data/../outside/secret",
                                 base_ + "/data/link/secret",  // a link out of the root
                                 base_ + "/data2/x", std::string("/etc/shadow"), std::string("/proc/x.npy"),
                                 base_ + "/ckpt/../data2/../outside/new"}) {
    const absl::Status s = policy_.Check("spec.train.data_path", bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << bad;
    EXPECT_NE(s.message().find("spec.train.data_path: '" + bad + "' is outside"), std::string::npos) << s;
  }
  // A NUL byte would make the check and open() see different paths; refused
  // even with no roots.
  const std::string nul = base_ + "/data/x" + std::string(1, '\0') + "/../../outside/secret";
  EXPECT_EQ(policy_.Check("f", nul).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(PathPolicy().Check("f", nul).code(), absl::StatusCode::kPermissionDenied);
  // Relative paths are the worker's working directory's.
  const fs::path cwd = fs::current_path();
  fs::current_path(base_ + "/data");
  EXPECT_TRUE(policy_.Check("f", "corpus.bin").ok());
  EXPECT_EQ(policy_.Check("f", "../outside/secret").code(), absl::StatusCode::kPermissionDenied);
  fs::current_path(cwd);
}

TEST_F(PathPolicyTest, EveryPathOfAJobSpecIsChecked) {
  v1::JobSpec ok;
  ok.mutable_model()->set_weights_path(base_ + "/data/model.safetensors");
  ok.mutable_train()->set_data_path(base_ + "/data/corpus.bin");
  ok.mutable_train()->set_checkpoint_dir(base_ + "/ckpt/a");
  ok.mutable_train()->set_resume_from(base_ + "/ckpt/a");
  ok.mutable_train()->set_final_dir(base_ + "/ckpt/final");
  ok.mutable_forward()->set_input_path(base_ + "/data/ids.npy");
  ok.mutable_forward()->set_logits_path(base_ + "/ckpt/logits.npy");
  EXPECT_TRUE(policy_.CheckJob(ok).ok());
  const std::vector<std::pair<std::string, std::function<void(v1::JobSpec&)>>> fields = {
      {"spec.model.weights_path", [](v1::JobSpec& s) { s.mutable_model()->set_weights_path("/etc/passwd"); }},
      {"spec.train.data_path", [](v1::JobSpec& s) { s.mutable_train()->set_data_path("/etc/shadow"); }},
      {"spec.train.checkpoint_dir", [](v1::JobSpec& s) { s.mutable_train()->set_checkpoint_dir("/tmp/x"); }},
      {"spec.train.resume_from", [](v1::JobSpec& s) { s.mutable_train()->set_resume_from("/tmp/x"); }},
      {"spec.train.final_dir", [](v1::JobSpec& s) { s.mutable_train()->set_final_dir("/usr/x"); }},
      {"spec.forward.input_path", [](v1::JobSpec& s) { s.mutable_forward()->set_input_path("/dev/zero"); }},
      {"spec.forward.logits_path", [](v1::JobSpec& s) { s.mutable_forward()->set_logits_path("/proc/x.npy"); }},
  };
  for (const auto& [field, set] : fields) {
    v1::JobSpec spec = ok;
    set(spec);
    const absl::Status s = policy_.CheckJob(spec);
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << field;
    EXPECT_EQ(s.message().rfind(field + ":", 0), 0u) << s;
  }
  // A Megatron dataset named by its prefix (or .bin) opens PREFIX.bin and
  // PREFIX.idx: a sibling that links outside is refused too.
  v1::JobSpec megatron = ok;
  std::ofstream(base_ + "/outside/stolen.idx") << "index";
  std::ofstream(base_ + "/data/ds.bin") << "tokens";
  fs::create_symlink(base_ + "/outside/stolen.idx", base_ + "/data/ds.idx");
  for (const std::string& path : {base_ + "/data/ds", base_ + "/data/ds.bin"}) {
    megatron.mutable_train()->set_data_path(path);
    const absl::Status s = policy_.CheckJob(megatron);
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << path << ": " << s;
    EXPECT_NE(s.message().find("ds.idx"), std::string::npos) << s;
  }
  // No roots: everything.
  v1::JobSpec anywhere = ok;
  anywhere.mutable_train()->set_data_path("/etc/shadow");
  EXPECT_TRUE(PathPolicy().CheckJob(anywhere).ok());
}

TEST(PathPolicy, RootsMustBeExistingAbsoluteDirectories) {
  EXPECT_EQ(PathPolicy::Create({"relative/dir"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PathPolicy::Create({"/nonexistent/colod"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PathPolicy::Create({"/etc/passwd"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PathPolicy::Create({""}).status().code(), absl::StatusCode::kInvalidArgument);
  auto root = PathPolicy::Create({"/"});
  ASSERT_TRUE(root.ok());
  EXPECT_TRUE(root->Check("f", "/etc/shadow").ok());
}

// The worker's own directory (its --work-dir, here inside an allowed
// root, as a Kubernetes pod's emptyDir holds both) is never a job's path:
// a FORWARD job's logits written over a cached upload's weights, or a
// final model into the cache, would be the next job's model. Through a
// link, "..", and with no roots at all too; the rest of the root is allowed.
TEST_F(PathPolicyTest, NoJobNamesTheWorkersOwnDirectory) {
  const std::string work = base_ + "/data/work";
  fs::create_directories(work + "/uploads/upload-000001-00000000000000aa");
  fs::create_symlink(work, base_ + "/data/to-work");
  const auto spec_with = [](const std::function<void(v1::JobSpec&)>& set) {
    v1::JobSpec spec;
    set(spec);
    return spec;
  };
  for (PathPolicy policy : {policy_, PathPolicy()}) {
    ASSERT_TRUE(policy.Reserve(work).ok());
    for (const std::string& bad :
         {work, work + "/uploads/upload-000001-00000000000000aa/model.safetensors", work + "/LOCK",
          base_ + "/data/to-work/uploads/x", base_ + "/data/sub/../work/flight-recorder"}) {
      for (const v1::JobSpec& spec : {spec_with([&](v1::JobSpec& s) { s.mutable_forward()->set_logits_path(bad); }),
                                      spec_with([&](v1::JobSpec& s) { s.mutable_train()->set_final_dir(bad); }),
                                      spec_with([&](v1::JobSpec& s) { s.mutable_train()->set_data_path(bad); })}) {
        const absl::Status s = policy.CheckJob(spec);
        EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << bad;
        EXPECT_NE(s.message().find("is in this worker's own directory"), std::string::npos) << s;
      }
    }
    EXPECT_TRUE(policy
                    .CheckJob(spec_with([&](v1::JobSpec& s) {
                      s.mutable_train()->set_final_dir(base_ + "/data/working-copy");  // a sibling name
                    }))
                    .ok());
    // Nor is a file of it reached through a link in an allowed directory
    // (a weights directory's file, which Materialize checks one by one).
    const std::string linked = base_ + "/data/weights-" + std::to_string(policy.unrestricted());
    fs::create_directories(linked);
    std::ofstream(work + "/uploads/upload-000001-00000000000000aa/model.safetensors") << "weights";
    fs::create_symlink(work + "/uploads/upload-000001-00000000000000aa/model.safetensors",
                       linked + "/model.safetensors");
    const absl::Status through_link = policy.Check("spec.model.weights_path", linked + "/model.safetensors");
    EXPECT_EQ(through_link.code(), absl::StatusCode::kPermissionDenied) << through_link;
    EXPECT_NE(through_link.message().find("is in this worker's own directory"), std::string::npos) << through_link;
  }
  PathPolicy none;
  EXPECT_EQ(none.Reserve(base_ + "/missing").code(), absl::StatusCode::kInvalidArgument);
  // A root in the work dir allows nothing: dropped (the others serve), and
  // where every root is one, refused (the worker does not start).
  auto inside = PathPolicy::Create({work + "/uploads"});
  ASSERT_TRUE(inside.ok()) << inside.status();
  const absl::Status root_inside = inside->Reserve(work);
  EXPECT_EQ(root_inside.code(), absl::StatusCode::kInvalidArgument) << root_inside;
  EXPECT_NE(root_inside.message().find("they would allow nothing"), std::string::npos) << root_inside;
  auto mixed = PathPolicy::Create({work, base_ + "/ckpt"});
  ASSERT_TRUE(mixed.ok()) << mixed.status();
  ASSERT_TRUE(mixed->Reserve(work).ok());
  EXPECT_EQ(mixed->roots(), std::vector<std::string>{base_ + "/ckpt"});
  EXPECT_TRUE(
      mixed->CheckJob(spec_with([&](v1::JobSpec& s) { s.mutable_train()->set_final_dir(base_ + "/ckpt/final"); }))
          .ok());
}

}  // namespace
}  // namespace colod
