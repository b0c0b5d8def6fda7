// A loopback TCP proxy whose two directions can each be held: what a
// client sends while it is paused (Pause), or what the target answers while
// replies are paused (PauseReplies), stays in the socket buffers and goes
// on, in order, at Resume / ResumeReplies. For tests that need calls or
// answers to arrive late without touching the servers (e.g. a shard's
// AbortStep to the leader landing after a worker's Recover, or a shard's
// pull reaching a worker after its step watchdog fired).
#ifndef GTOPK_TESTS_TESTING_PAUSABLE_PROXY_H_
#define GTOPK_TESTS_TESTING_PAUSABLE_PROXY_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace gtopk {
namespace testing {

class PausableProxy {
 public:
  // Listens on 127.0.0.1:<free port>. Connections accepted before
  // set_target are held until it is called. INTERNAL when the socket
  // cannot be bound.
  static absl::StatusOr<std::unique_ptr<PausableProxy>> Start() {
    auto proxy = std::unique_ptr<PausableProxy>(new PausableProxy());
    proxy->listener_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr;
    std::memset(&addr, 0, sizeof(addr));
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (proxy->listener_ < 0 ||
        bind(proxy->listener_, reinterpret_cast<sockaddr*>(&addr),
             sizeof(addr)) != 0 ||
        getsockname(proxy->listener_, reinterpret_cast<sockaddr*>(&addr),
                    &len) != 0 ||
        listen(proxy->listener_, 16) != 0) {
      return absl::InternalError("PausableProxy: cannot listen on loopback");
    }
    proxy->port_ = ntohs(addr.sin_port);
    proxy->accepter_ = std::thread([p = proxy.get()] { p->Accept(); });
    return proxy;
  }

  ~PausableProxy() {
    {
      absl::MutexLock lock(&mu_);  // wakes an accept waiting for the target
      stop_.store(true);
    }
    shutdown(listener_, SHUT_RDWR);
    close(listener_);
    accepter_.join();
    for (std::thread& t : pumps_) t.join();
    for (int fd : fds_) close(fd);
  }
  PausableProxy(const PausableProxy&) = delete;
  PausableProxy& operator=(const PausableProxy&) = delete;

  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  // Where accepted connections go: a port on 127.0.0.1.
  void set_target(int port) {
    absl::MutexLock lock(&mu_);
    target_port_ = port;
  }
  // Holds (Pause) or releases (Resume) the bytes clients send. Pause
  // returns once no copy is under way: nothing sent after it is forwarded
  // before Resume.
  void Pause() {
    absl::WriterMutexLock lock(&pause_mu_);
    paused_.store(true);
  }
  void Resume() { paused_.store(false); }
  // The same for the target-to-client direction (the answers).
  void PauseReplies() {
    absl::WriterMutexLock lock(&pause_mu_);
    replies_paused_.store(true);
  }
  void ResumeReplies() { replies_paused_.store(false); }

 private:
  PausableProxy() = default;

  void Accept() {
    while (!stop_.load()) {
      const int client = accept(listener_, nullptr, nullptr);
      if (client < 0) return;  // closed by the destructor
      int port = 0;
      {
        absl::MutexLock lock(&mu_);
        auto known = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return target_port_ != 0 || stop_.load();
        };
        mu_.Await(absl::Condition(&known));
        port = target_port_;
      }
      const int upstream = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr;
      std::memset(&addr, 0, sizeof(addr));
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      addr.sin_port = htons(static_cast<uint16_t>(port));
      if (upstream < 0 || connect(upstream, reinterpret_cast<sockaddr*>(&addr),
                                  sizeof(addr)) != 0) {
        close(client);
        if (upstream >= 0) close(upstream);
        continue;
      }
      const int one = 1;
      for (int fd : {client, upstream}) {
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      }
      fds_.push_back(client);
      fds_.push_back(upstream);
      pumps_.emplace_back(
          [this, client, upstream] { Pump(client, upstream, &paused_); });
      pumps_.emplace_back([this, client, upstream] {
        Pump(upstream, client, &replies_paused_);
      });
    }
  }

  // Copies from `from` to `to` until either closes or the proxy stops;
  // while `*paused` (this direction's flag), reads nothing.
  void Pump(int from, int to, const std::atomic<bool>* paused) {
    std::vector<char> buffer(64 * 1024);
    while (!stop_.load()) {
      if (paused->load()) {
        usleep(1000);
        continue;
      }
      pollfd p{from, POLLIN, 0};
      if (poll(&p, 1, 20) <= 0) continue;
      absl::ReaderMutexLock lock(&pause_mu_);
      // Paused while polling: what came stays unread.
      if (paused->load()) continue;
      if (!Copy(from, to, buffer)) break;
    }
    shutdown(to, SHUT_WR);
  }

  // One read from `from`, all of it written to `to`; false when either
  // is closed. MSG_NOSIGNAL: a peer that went away (a shard restarted
  // behind the proxy) ends the copy instead of killing the test process
  // with SIGPIPE.
  static bool Copy(int from, int to, std::vector<char>& buffer) {
    const ssize_t got = read(from, buffer.data(), buffer.size());
    if (got <= 0) return false;
    for (ssize_t sent = 0; sent < got;) {
      const ssize_t n =
          send(to, buffer.data() + sent, got - sent, MSG_NOSIGNAL);
      if (n <= 0) return false;
      sent += n;
    }
    return true;
  }

  int listener_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<bool> paused_{false};
  std::atomic<bool> replies_paused_{false};
  absl::Mutex pause_mu_;  // held shared by each copy, exclusively by Pause
  absl::Mutex mu_;
  int target_port_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread accepter_;
  // Written by the accept thread only; read by the destructor after it.
  std::vector<std::thread> pumps_;
  std::vector<int> fds_;
};

}  // namespace testing
}  // namespace gtopk

#endif  // GTOPK_TESTS_TESTING_PAUSABLE_PROXY_H_
