#include "common/metrics.h"

#include <dlfcn.h>
#include <netdb.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <exception>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "civetweb.h"
#include "common/built_with_cuda.h"
#include "common/net.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "prometheus/gauge.h"
#include "prometheus/text_serializer.h"

// civetweb (prometheus-cpp's HTTP server) starts its threads with a fixed
// 100 KiB stack (pthread_attr_setstacksize). glibc carves every thread's
// static TLS out of its stack, and with OpenBLAS and the CUDA libraries
// (cuBLASLt alone has 92 KiB of TLS) loaded that is more than 100 KiB, so
// pthread_create fails with EINVAL and /metrics cannot start ("Cannot create
// first worker thread"). This definition, exported by the binary, takes
// precedence over glibc's for every caller and raises small requests to a
// floor that leaves room for the TLS; larger requests pass unchanged.
extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t size) {
  constexpr size_t kFloor = size_t{1} << 20;
  using Fn = int (*)(pthread_attr_t*, size_t);
  static const Fn real = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  if (real == nullptr) return EINVAL;
  return real(attr, std::max(size, kFloor));
}

namespace colod {

class MetricsServer::Handler : public CivetHandler {
 public:
  explicit Handler(std::shared_ptr<prometheus::Registry> registry) : registry_(std::move(registry)) {}

  bool handleGet(CivetServer*, mg_connection* conn) override {
    const std::string body = prometheus::TextSerializer().Serialize(registry_->Collect());
    mg_printf(conn,
              "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
              "Content-Length: %zu\r\nConnection: close\r\n\r\n",
              body.size());
    mg_write(conn, body.data(), body.size());
    return true;
  }

 private:
  const std::shared_ptr<prometheus::Registry> registry_;
};

namespace {

// Opens and closes one TCP connection to host:port (a wildcard host means
// this machine), waiting at most 100 ms for it.
void Knock(const std::string& host, int port) {
  std::string target = host;
  if (target.empty() || target == "0.0.0.0") target = "127.0.0.1";
  if (target == "::") target = "::1";
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (getaddrinfo(target.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    timeval limit{0, 100 * 1000};
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof(limit));
    const bool connected = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0;
    ::close(fd);
    if (connected) break;
  }
  freeaddrinfo(found);
}

}  // namespace

MetricsServer::~MetricsServer() {
  // civetweb's listener thread polls its sockets in 2 s quanta and sees
  // mg_stop's stop flag only when a poll returns, so a plain stop took 2 s:
  // every daemon's shutdown, and every test that stops one. While the stop
  // waits, connections to the port end the poll (one accepted before
  // the flag is set is an empty request, closed at once). Bounded: the
  // knocking ends with the stop, or after about 3 s if it never does.
  std::atomic<bool> stopped{false};
  std::thread knocker;
  if (server_ != nullptr && port_ > 0) {
    try {
      knocker = std::thread([this, &stopped] {
        for (int i = 0; i < 300 && !stopped.load(); ++i) {
          Knock(host_, port_);
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      });
    } catch (const std::system_error&) {
      // No thread to be had (a destructor must not throw): the stop takes its 2 s.
    }
  }
  server_.reset();  // joins civetweb's threads before the handler goes
  stopped = true;
  if (knocker.joinable()) knocker.join();
  handler_.reset();
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    absl::string_view listen, std::shared_ptr<prometheus::Registry> registry) {
  ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(listen, "--metrics-listen", /*allow_zero_port=*/true));
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  const std::string address = hp.ToString();
  const std::vector<std::string> options = {"listening_ports", address, "num_threads", "2"};
  try {
    server->server_ = std::make_unique<CivetServer>(options);
  } catch (const std::exception& e) {
    // CivetServer drops civetweb's reason; ask civetweb directly for it.
    const char* raw[] = {"listening_ports", address.c_str(), "num_threads", "2", nullptr};
    mg_callbacks callbacks{};
    mg_init_data init{};
    init.callbacks = &callbacks;
    init.configuration_options = raw;
    char text[256] = {0};
    mg_error_data error{};
    error.text = text;
    error.text_buffer_size = sizeof(text);
    if (mg_context* ctx = mg_start2(&init, &error); ctx != nullptr) mg_stop(ctx);
    return absl::UnavailableError(
        absl::StrCat("cannot serve /metrics on ", address, ": ", e.what(), " (civetweb: ", text, ")"));
  }
  std::vector<int> ports = server->server_->getListeningPorts();
  if (ports.empty() || ports[0] <= 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve /metrics on ", address,
                                               ": no listening port was reported"));
  }
  server->port_ = ports[0];
  server->host_ = hp.host;
  hp.port = ports[0];
  server->address_ = hp.ToString();
  server->registry_ = std::move(registry);
  server->handler_ = std::make_unique<Handler>(server->registry_);
  server->server_->addHandler("/metrics", server->handler_.get());
  return server;
}

void AddBuildInfo(prometheus::Registry& registry, absl::string_view component) {
  const char* cuda = BuiltWithCuda() ? "true" : "false";
  prometheus::BuildGauge()
      .Name("colod_build_info")
      .Help("Build of this colod binary: always 1, the facts are in the labels.")
      .Register(registry)
      .Add({{"component", std::string(component)}, {"version", kVersion}, {"cuda", cuda}})
      .Set(1);
}

}  // namespace colod
