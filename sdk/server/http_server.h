// HttpServer: a small HTTP/1.1 server on Boost.Beast for the knowledge-base
// browser. One thread runs an asio io_context; every connection is an
// asynchronous session, so a slow client never blocks the others. Handlers
// are fast (memory scans of a snapshot), which is why one thread suffices.
//
// Limits, enforced before the handler runs: the request header (line and
// fields) is at most max_header_bytes (431 otherwise); a request with a body
// is refused (400: the browser is read-only, there is nothing to upload); a
// connection waits at most idle_timeout_s for the first byte of a request,
// and once it has come, the whole header must arrive within
// header_timeout_s (a client trickling its header ties up a connection for
// seconds, not half a minute); at most max_connections are open, and a new
// connection beyond them closes the oldest one that is waiting for a
// request, or, when every one is writing a response, the one whose write has
// been stalled longest (a client that pipelines requests and never reads its
// answers stalls its writes for good); only when every connection is writing
// and none is stalled is the new one closed. Every HTTP/1.1 request has
// exactly one Host header (RFC 9112: 400 for none or several), and a request
// with a Transfer-Encoding is a 400 (it announces a body, and RFC 9112 asks
// a 400 for any coding but a final chunked). When the server listens on a loopback address it
// also checks the Host header (localhost, 127.0.0.1, [::1], in any case), so
// a web page elsewhere cannot reach it through DNS rebinding; an HTTP/1.0
// request without one is served (browsers always send it).
//
// Thread-safety: Run() blocks the calling thread; Stop() may be called from
// any thread (or a signal handler context through asio's signal_set, which
// Run installs when handle_signals is set) and makes Run return after open
// responses finished.
#ifndef OOMGUARD_SDK_SERVER_HTTP_SERVER_H_
#define OOMGUARD_SDK_SERVER_HTTP_SERVER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "oomguard/status.h"
#include "sdk/server/browser_api.h"

namespace oomguard::server {

struct HttpServerOptions {
  // Address to listen on; loopback by default (incidents are not public data).
  std::string bind = "127.0.0.1";
  // TCP port; 0 picks a free one (see HttpServer::port()).
  uint16_t port = 8080;
  // Largest request line plus header fields, in bytes.
  size_t max_header_bytes = 8 * 1024;
  // A connection with no byte of a new request for this long is closed.
  int idle_timeout_s = 30;
  // Once a request's first byte has come, its whole header must arrive within this.
  int header_timeout_s = 5;
  // Open connections at most; a new one beyond closes the oldest that waits
  // for a request, else the longest-stalled writer.
  size_t max_connections = 128;
  // A response still being written after this long is stalled: the client
  // does not read it. Its connection may make room for a new one.
  int stalled_write_ms = 1000;
  // Stop on SIGINT and SIGTERM (the `kb serve` command); tests leave it off.
  bool handle_signals = false;
};

class HttpServer {
 public:
  // `authorization`: the request's Authorization header ("" when none).
  using Handler =
      std::function<HttpResponse(std::string_view method, std::string_view target, std::string_view authorization)>;

  // Binds and listens (the port is known when this returns). Errors:
  // kInvalidArgument for a bad address, kUnavailable when the port is taken
  // or cannot be bound; the message names the address.
  static StatusOr<std::unique_ptr<HttpServer>> Listen(const HttpServerOptions& options, Handler handler);
  ~HttpServer();

  // Serves until Stop() (or a signal, with handle_signals).
  void Run();
  void Stop();

  uint16_t port() const;
  // "http://HOST:PORT/" with IPv6 hosts in brackets.
  std::string url() const;

  class Impl;

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace oomguard::server

#endif  // OOMGUARD_SDK_SERVER_HTTP_SERVER_H_
