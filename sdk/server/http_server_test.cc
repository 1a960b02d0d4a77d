// HttpServer against raw sockets (issue 15, items 10 and 11; issue 28, rows 7
// and 15): the Host and Transfer-Encoding rules of RFC 9112, a header that
// trickles in is cut off by the header timeout (not the idle one), and a
// server full of slow connections, or of clients that pipeline requests and
// never read the answers, still serves a new client.
#include "sdk/server/http_server.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace oomguard::server {
namespace {

using Clock = std::chrono::steady_clock;

// A server on 127.0.0.1 with a port of its own, run on a thread.
class Served {
 public:
  explicit Served(HttpServerOptions o, std::string body = "hello") {
    o.bind = "127.0.0.1";
    o.port = 0;
    server_ = HttpServer::Listen(o, [body = std::move(body)](std::string_view, std::string_view, std::string_view) {
                return HttpResponse{200, "text/plain", body, {}};
              }).value();
    thread_ = std::thread([this] { server_->Run(); });
  }
  ~Served() {
    server_->Stop();
    thread_.join();
  }
  uint16_t port() const { return server_->port(); }

 private:
  std::unique_ptr<HttpServer> server_;
  std::thread thread_;
};

int Connect(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  return fd;
}

void Send(int fd, const std::string& s) { (void)::send(fd, s.data(), s.size(), MSG_NOSIGNAL); }

// Reads until the peer closes or `timeout` passes; returns what came.
std::string Receive(int fd, std::chrono::milliseconds timeout, bool* closed = nullptr) {
  std::string out;
  const auto end = Clock::now() + timeout;
  if (closed != nullptr) *closed = false;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count();
    if (left <= 0) return out;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    char buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) {
      if (closed != nullptr) *closed = true;
      return out;
    }
    out.append(buf, static_cast<size_t>(n));
  }
}

std::string Ask(uint16_t port, const std::string& request) {
  int fd = Connect(port);
  Send(fd, request);
  std::string r = Receive(fd, std::chrono::milliseconds(3000));
  ::close(fd);
  return r;
}

TEST(HttpServer, HostHeaderFollowsRfc9112AndIgnoresCase) {
  Served s({});
  auto status = [&](const std::string& head) { return Ask(s.port(), head + "\r\n").substr(0, 12); };
  EXPECT_EQ(status("GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"), "HTTP/1.1 200");
  EXPECT_EQ(status("GET / HTTP/1.1\r\nHost: LOCALHOST\r\nConnection: close\r\n"), "HTTP/1.1 200");
  EXPECT_EQ(status("GET / HTTP/1.1\r\nHost: LocalHost:8080\r\nConnection: close\r\n"), "HTTP/1.1 200");
  EXPECT_EQ(status("GET / HTTP/1.0\r\n"), "HTTP/1.0 200");
  EXPECT_EQ(status("GET / HTTP/1.1\r\nConnection: close\r\n"), "HTTP/1.1 400");
  EXPECT_EQ(status("GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n"), "HTTP/1.1 400");
  EXPECT_EQ(status("GET / HTTP/1.1\r\nHost: localhost\r\nHost: localhost\r\n"), "HTTP/1.1 400");
  EXPECT_EQ(status("GET / HTTP/1.0\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n"), "HTTP/1.1 400");
  EXPECT_EQ(status("GET / HTTP/1.1\r\nHost: evil.example\r\n"), "HTTP/1.1 421");
  EXPECT_EQ(status("GET / HTTP/1.1\r\nHost: localhost.evil.example\r\n"), "HTTP/1.1 421");
}

// RFC 9112, 6.3: a Transfer-Encoding whose last coding is not chunked is a
// 400; a chunked one announces a body, which this server never takes.
TEST(HttpServer, TransferEncodingIsRefused) {
  Served s({});
  auto status = [&](const std::string& head) { return Ask(s.port(), head + "\r\n").substr(0, 12); };
  const std::string get = "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
  EXPECT_EQ(status(get), "HTTP/1.1 200");
  EXPECT_EQ(status(get + "Transfer-Encoding: gzip\r\n"), "HTTP/1.1 400");
  EXPECT_EQ(status(get + "Transfer-Encoding: chunked, identity\r\n"), "HTTP/1.1 400");
  EXPECT_EQ(status(get + "Transfer-Encoding: identity\r\n"), "HTTP/1.1 400");
  EXPECT_EQ(Ask(s.port(), get + "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n").substr(0, 12), "HTTP/1.1 400");
}

// A client that sends its header a byte at a time is cut off by the header
// timeout; one that connects and waits before sending gets the idle timeout.
TEST(HttpServer, TricklingHeaderIsCutOffByTheHeaderTimeout) {
  HttpServerOptions o;
  o.header_timeout_s = 1;
  o.idle_timeout_s = 30;
  Served s(o);
  int slow = Connect(s.port());
  const auto t0 = Clock::now();
  const std::string head =
      "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
  bool closed = false;
  for (char c : head) {
    Send(slow, std::string(1, c));
    (void)Receive(slow, std::chrono::milliseconds(100), &closed);
    if (closed) break;
  }
  const double held = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_TRUE(closed) << "the trickling client was still connected after " << held << " s";
  EXPECT_LT(held, 3.0);
  ::close(slow);

  int patient = Connect(s.port());
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // longer than the header timeout
  Send(patient, "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(Receive(patient, std::chrono::milliseconds(3000)).substr(0, 12), "HTTP/1.1 200");
  ::close(patient);
}

// More slow clients than connections: a new client is still served, and it
// is the oldest waiting connection that makes room.
TEST(HttpServer, FullServerShedsTheOldestWaitingConnection) {
  HttpServerOptions o;
  o.max_connections = 8;
  Served s(o);
  std::vector<int> slow;
  for (int i = 0; i < 10; ++i) {
    slow.push_back(Connect(s.port()));
    Send(slow.back(), "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const auto t0 = Clock::now();
  const std::string r = Ask(s.port(), "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(r.substr(0, 12), "HTTP/1.1 200") << "a new client was locked out";
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 2.0);
  bool closed = false;
  (void)Receive(slow.front(), std::chrono::milliseconds(500), &closed);
  EXPECT_TRUE(closed) << "the oldest slow connection should have been closed";
  (void)Receive(slow.back(), std::chrono::milliseconds(100), &closed);
  EXPECT_FALSE(closed) << "the newest slow connection should still be open";
  for (int fd : slow) ::close(fd);
}

// Issue 28, row 7: every connection pipelines requests for a large answer
// and never reads, so every one is stuck writing. A new client is served
// anyway: the longest-stalled writer makes room (before, new connections
// were closed at once for as long as the writes' 30 s timeout, renewable
// by reconnecting).
TEST(HttpServer, FullServerShedsAStalledWriterForANewClient) {
  HttpServerOptions o;
  o.max_connections = 4;
  o.stalled_write_ms = 200;
  Served s(o, std::string(size_t{4} << 20, 'x'));  // like /app.js, but larger than any socket buffer
  std::string pipelined;
  for (int i = 0; i < 32; ++i) pipelined += "GET /app.js HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
  std::vector<int> readers;
  for (int i = 0; i < 4; ++i) {
    readers.push_back(Connect(s.port()));
    Send(readers.back(), pipelined);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(600));  // every write stalls
  for (int round = 0; round < 3; ++round) {  // and again, as a reconnecting client would renew them
    const auto t0 = Clock::now();
    int fd = Connect(s.port());
    Send(fd, "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    std::string r;
    bool closed = false;
    while (r.size() < 12 && !closed) r += Receive(fd, std::chrono::milliseconds(3000), &closed);
    ::close(fd);
    EXPECT_EQ(r.substr(0, 12), "HTTP/1.1 200") << "round " << round << ": a new client was locked out";
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 2.0);
    readers.push_back(Connect(s.port()));  // a non-reader takes the slot back
    Send(readers.back(), pipelined);
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
  }
  for (int fd : readers) ::close(fd);
}

}  // namespace
}  // namespace oomguard::server
