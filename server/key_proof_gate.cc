#include "server/key_proof_gate.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace colod {

namespace {

// "2001:db8::7" (no brackets, no zone) -> "ipv6:[2001:db8::]/64"; "" where
// it is not an IPv6 address.
std::string Ipv6Prefix(const std::string &literal) {
  in6_addr a{};
  if (::inet_pton(AF_INET6, literal.c_str(), &a) != 1) return "";
  for (int i = 8; i < 16; ++i) a.s6_addr[i] = 0;
  char text[INET6_ADDRSTRLEN] = {0};
  if (::inet_ntop(AF_INET6, &a, text, sizeof(text)) == nullptr) return "";
  return absl::StrCat("ipv6:[", text, "]/64");
}

}  // namespace

std::string PeerHost(absl::string_view peer) {
  if (absl::StartsWith(peer, "ipv6:")) {
    // "ipv6:[ADDR]:PORT" or "ipv6:%5BADDR%5D:PORT", ADDR perhaps with a
    // zone ("%25eth0" or "%eth0").
    std::string rest = absl::StrReplaceAll(peer.substr(5), {{"%5B", "["}, {"%5b", "["}, {"%5D", "]"}, {"%5d", "]"}});
    const size_t open = rest.find('['), close = rest.find(']');
    if (open == 0 && close != std::string::npos) {
      std::string literal = rest.substr(1, close - 1);
      literal = literal.substr(0, literal.find('%'));
      if (std::string prefix = Ipv6Prefix(literal); !prefix.empty()) return prefix;
    }
  }
  const size_t colon = peer.rfind(':');
  // "unix:/path" has no port: the whole of it.
  if (colon == absl::string_view::npos || peer.find_first_not_of("0123456789", colon + 1) != absl::string_view::npos ||
      colon + 1 == peer.size() || peer.find(':') == colon) {
    return std::string(peer);
  }
  return std::string(peer.substr(0, colon));
}

KeyProofGate::KeyProofGate(Options options) : options_(std::move(options)) {}

absl::Status KeyProofGate::Enter(absl::string_view peer_host, absl::string_view address) {
  const absl::Time now = options_.clock->Now();
  absl::MutexLock lock(&mu_);
  if (auto it = unreachable_.find(address); it != unreachable_.end()) {
    if (now - it->second < options_.unreachable_for) {
      return absl::UnavailableError(
          absl::StrCat("the coordinator could not reach ", address, ", the address this worker registers, ",
                       absl::FormatDuration(absl::Trunc(now - it->second, absl::Seconds(1))),
                       " ago, and calls it again once ", absl::FormatDuration(options_.unreachable_for),
                       " passed: it calls its workers there (a worker's --advertise-host "
                       "names the host it is reached at)"));
    }
    unreachable_.erase(it);
  }
  if (running_ >= options_.max) {
    return absl::UnavailableError(absl::StrCat("the coordinator is checking ", options_.max,
                                               " other registrations at their addresses: try again"));
  }
  const std::string by_address = absl::StrCat(peer_host, " ", address);
  if (by_address_.contains(by_address)) {
    return absl::UnavailableError(
        absl::StrCat("the coordinator is checking another registration at ", address, " from this host: try again"));
  }
  if (auto it = by_peer_.find(peer_host); it != by_peer_.end() && it->second >= options_.max_per_peer) {
    return absl::UnavailableError(absl::StrCat("the coordinator is checking ", options_.max_per_peer,
                                               " other registrations from this host at their addresses: try again"));
  }
  ++running_;
  ++by_peer_[peer_host];
  ++by_address_[by_address];
  return absl::OkStatus();
}

void KeyProofGate::Leave(absl::string_view peer_host, absl::string_view address, bool unreachable) {
  const absl::Time now = options_.clock->Now();
  absl::MutexLock lock(&mu_);
  --running_;
  if (auto it = by_peer_.find(peer_host); it != by_peer_.end() && --it->second <= 0) by_peer_.erase(it);
  if (auto it = by_address_.find(absl::StrCat(peer_host, " ", address)); it != by_address_.end() && --it->second <= 0) {
    by_address_.erase(it);
  }
  if (!unreachable || options_.max_remembered == 0) return;
  if (unreachable_.size() >= options_.max_remembered && !unreachable_.contains(address)) {
    // Those past unreachable_for first, then the oldest.
    absl::erase_if(unreachable_, [&](const auto &e) { return now - e.second >= options_.unreachable_for; });
    if (unreachable_.size() >= options_.max_remembered) {
      unreachable_.erase(std::min_element(unreachable_.begin(), unreachable_.end(),
                                          [](const auto &a, const auto &b) { return a.second < b.second; }));
    }
  }
  unreachable_[address] = now;
}

}  // namespace colod
