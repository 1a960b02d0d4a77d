#include "sdk/server/http_server.h"

#include <algorithm>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cctype>
#include <chrono>
#include <list>
#include <optional>

namespace oomguard::server {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

namespace {

bool IsLoopback(const asio::ip::address& a) { return a.is_loopback(); }

// The host part of a Host header ("127.0.0.1:8080" -> "127.0.0.1", "[::1]:80" -> "[::1]").
std::string_view HostOnly(std::string_view host) {
  if (!host.empty() && host[0] == '[') {
    size_t close = host.find(']');
    return close == std::string_view::npos ? host : host.substr(0, close + 1);
  }
  size_t colon = host.find(':');
  return colon == std::string_view::npos ? host : host.substr(0, colon);
}

}  // namespace

class HttpServer::Impl {
 public:
  Impl(HttpServerOptions options, Handler handler)
      : options_(std::move(options)), handler_(std::move(handler)), acceptor_(ioc_), signals_(ioc_) {}

  class Session;

  Status Listen() {
    boost::system::error_code ec;
    asio::ip::address addr = asio::ip::make_address(options_.bind, ec);
    if (ec) return Status::InvalidArgument("--bind '" + options_.bind + "': not an IP address");
    loopback_ = IsLoopback(addr);
    tcp::endpoint ep(addr, options_.port);
    std::string where = options_.bind + ":" + std::to_string(options_.port);
    acceptor_.open(ep.protocol(), ec);
    if (!ec) acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) acceptor_.bind(ep, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) return Status::Unavailable("cannot listen on " + where + ": " + ec.message());
    port_ = acceptor_.local_endpoint().port();
    host_ = addr.is_v6() ? "[" + addr.to_string() + "]" : addr.to_string();
    return Status::Ok();
  }

  void Run() {
    if (options_.handle_signals) {
      signals_.add(SIGINT);
      signals_.add(SIGTERM);
      signals_.async_wait([this](const boost::system::error_code& ec, int) {
        if (!ec) StopOnLoop();
      });
    }
    Accept();
    ioc_.run();
  }

  void Stop() {
    asio::post(ioc_, [this] { StopOnLoop(); });
  }

  // Runs on the loop: no new connections, idle ones closed, a response being
  // written may finish; a last-resort timer ends the loop regardless.
  void StopOnLoop();
  // Ends the loop once every session closed, polling every 20 ms, at most `ticks_left` times.
  void WaitForSessions(int ticks_left);
  void Accept();
  void Forget(Session* s);
  bool HostAllowed(std::string_view host) const {
    if (!loopback_) return true;
    // Host names are case-insensitive (RFC 3986, 3.2.2).
    std::string h(HostOnly(host));
    for (char& c : h) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return h == "127.0.0.1" || h == "localhost" || h == "[::1]" || h == host_;
  }
  // Makes room for a new connection: closes the oldest session that is
  // waiting for a request, else the one whose write has been stalled longest
  // (stalled_write_ms). False when every session is writing and none stalled.
  bool ShedOne();

  HttpServerOptions options_;
  Handler handler_;
  asio::io_context ioc_{1};
  tcp::acceptor acceptor_;
  asio::signal_set signals_;
  std::optional<asio::steady_timer> stop_timer_;
  std::list<std::weak_ptr<Session>> sessions_;  // loop thread only
  bool stopping_ = false;                       // loop thread only
  bool loopback_ = true;
  uint16_t port_ = 0;
  std::string host_;
};

class HttpServer::Impl::Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, Impl* server) : stream_(std::move(socket)), server_(server) {}

  void Start() { Read(); }
  // Waiting for (or reading) a request rather than writing a response.
  bool waiting() const { return !writing_ && !closing_; }
  // Writing a response since (valid while writing()).
  bool writing() const { return writing_ && !closing_; }
  std::chrono::steady_clock::time_point write_started() const { return write_started_; }

  // Closes the connection now, a response being written included (its write
  // completes with an error and the session ends).
  void CloseNow() {
    closing_ = true;
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.socket().close(ec);
  }

  // Closes a connection that is waiting for a request; one that is writing a
  // response finishes it and closes afterwards.
  void CloseIfIdle() {
    closing_ = true;
    if (!writing_) {
      beast::error_code ec;
      stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
      stream_.socket().close(ec);
    }
  }

  std::list<std::weak_ptr<Session>>::iterator self_in_list;

 private:
  // Waits (up to the idle timeout) for the first bytes of the next request;
  // only then does the header's own, shorter clock start.
  void Read() {
    parser_.emplace();
    parser_->header_limit(static_cast<std::uint32_t>(server_->options_.max_header_bytes));
    parser_->body_limit(0);
    if (buffer_.size() > 0) return ReadHeader();  // a pipelined request is already here
    stream_.expires_after(std::chrono::seconds(server_->options_.idle_timeout_s));
    stream_.async_read_some(buffer_.prepare(1024),
                            [self = shared_from_this()](beast::error_code ec, size_t n) {
                              self->buffer_.commit(n);
                              if (ec || self->closing_) return self->Close();
                              self->ReadHeader();
                            });
  }

  void ReadHeader() {
    stream_.expires_after(std::chrono::seconds(server_->options_.header_timeout_s));
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t) { self->OnRead(ec); });
  }

  void OnRead(beast::error_code ec) {
    if (ec == http::error::end_of_stream || ec == beast::error::timeout ||
        ec == asio::error::operation_aborted || closing_) {
      return Close();
    }
    if (ec == http::error::header_limit) return Send(Plain(431, "request header too large"), true);
    if (ec == http::error::body_limit || ec == http::error::unexpected_body)
      return Send(Plain(400, "requests with a body are not accepted (the browser is read-only)"), true);
    if (ec) {
      if (ec.category() == http::make_error_code(http::error::bad_target).category())
        return Send(Plain(400, "malformed request"), true);
      return Close();
    }
    const auto& req = parser_->get();
    // RFC 9112, 3.2: 400 for an HTTP/1.1 request without a Host header, and
    // for any request with more than one (a first, loopback one must not
    // vouch for a second).
    const size_t hosts = req.count(http::field::host);
    if (hosts > 1) return Send(Plain(400, "more than one Host header"), true);
    if (hosts == 0 && req.version() >= 11)
      return Send(Plain(400, "an HTTP/1.1 request needs a Host header"), true);
    if (hosts == 1 &&
        !server_->HostAllowed(std::string_view(req[http::field::host].data(), req[http::field::host].size())))
      return Send(Plain(421, "this server answers only to localhost (Host header rejected)"), true);
    // RFC 9112, 6.3: a request whose codings do not end in chunked is a 400;
    // one that does announces a body, and this server takes none.
    if (req.count(http::field::transfer_encoding) > 0)
      return Send(Plain(400, "requests with a body (Transfer-Encoding) are not accepted"), true);
    const bool head = req.method() == http::verb::head;
    std::string_view method(req.method_string().data(), req.method_string().size());
    std::string_view target(req.target().data(), req.target().size());
    std::string_view authorization;
    if (auto it = req.find(http::field::authorization); it != req.end())
      authorization = std::string_view(it->value().data(), it->value().size());
    HttpResponse r = server_->handler_(method, target, authorization);
    auto res = std::make_shared<http::response<http::string_body>>(static_cast<http::status>(r.status),
                                                                   req.version());
    res->set(http::field::server, "oomguard");
    res->set(http::field::content_type, r.content_type);
    for (const auto& [k, v] : r.headers) res->set(k, v);
    const size_t length = r.body.size();
    if (!head) res->body() = std::move(r.body);
    res->content_length(length);
    res->keep_alive(req.keep_alive() && !closing_);
    Write(std::move(res));
  }

  http::response<http::string_body> Plain(int status, const char* text) {
    http::response<http::string_body> res(static_cast<http::status>(status), 11);
    res.set(http::field::server, "oomguard");
    res.set(http::field::content_type, "application/json; charset=utf-8");
    res.body() = std::string("{\"error\":\"") + text + "\",\"status\":" + std::to_string(status) + "}";
    res.prepare_payload();
    res.keep_alive(false);
    return res;
  }

  void Send(http::response<http::string_body> res, bool close) {
    auto p = std::make_shared<http::response<http::string_body>>(std::move(res));
    if (close) p->keep_alive(false);
    Write(std::move(p));
  }

  void Write(std::shared_ptr<http::response<http::string_body>> res) {
    writing_ = true;
    write_started_ = std::chrono::steady_clock::now();
    stream_.expires_after(std::chrono::seconds(server_->options_.idle_timeout_s));
    http::async_write(stream_, *res, [self = shared_from_this(), res](beast::error_code ec, size_t) {
      self->writing_ = false;
      if (ec || !res->keep_alive() || self->closing_) return self->Close();
      self->Read();
    });
  }

  void Close() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    stream_.socket().close(ec);
    server_->Forget(this);
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::empty_body>> parser_;
  Impl* server_;
  bool writing_ = false;
  bool closing_ = false;
  bool forgotten_ = false;
  std::chrono::steady_clock::time_point write_started_;
  friend class Impl;
};

void HttpServer::Impl::Accept() {
  acceptor_.async_accept([this](beast::error_code ec, tcp::socket socket) {
    if (stopping_ || ec == asio::error::operation_aborted) return;
    if (!ec) {
      // Drop expired entries before counting.
      sessions_.remove_if([](const std::weak_ptr<Session>& w) { return w.expired(); });
      // Full: the oldest connection waiting for a request, or the longest
      // stalled writer, makes room, so that slow, idle or non-reading
      // clients cannot lock new ones out.
      if (sessions_.size() >= options_.max_connections && !ShedOne()) {
        beast::error_code ignored;
        socket.close(ignored);
      } else {
        auto s = std::make_shared<Session>(std::move(socket), this);
        sessions_.push_front(s);
        s->self_in_list = sessions_.begin();
        s->Start();
      }
    }
    Accept();
  });
}

bool HttpServer::Impl::ShedOne() {
  // sessions_ is newest first.
  std::shared_ptr<Session> stalled;
  const auto now = std::chrono::steady_clock::now();
  const auto stall = std::chrono::milliseconds(options_.stalled_write_ms);
  for (auto it = sessions_.rbegin(); it != sessions_.rend(); ++it) {
    auto s = it->lock();
    if (s == nullptr) continue;
    if (s->waiting()) {
      s->CloseIfIdle();
      Forget(s.get());  // counted out now; its read completes (aborted) later
      return true;
    }
    if (s->writing() && now - s->write_started() >= stall &&
        (stalled == nullptr || s->write_started() < stalled->write_started()))
      stalled = std::move(s);
  }
  if (stalled == nullptr) return false;
  stalled->CloseNow();
  Forget(stalled.get());  // its write completes (aborted) later
  return true;
}

void HttpServer::Impl::Forget(Session* s) {
  if (s->forgotten_) return;
  s->forgotten_ = true;
  sessions_.erase(s->self_in_list);
}

void HttpServer::Impl::StopOnLoop() {
  if (stopping_) return;
  stopping_ = true;
  beast::error_code ec;
  acceptor_.close(ec);
  signals_.cancel(ec);
  // Copy: CloseIfIdle may not erase (closing a socket completes its read later).
  std::vector<std::shared_ptr<Session>> open;
  for (auto& w : sessions_)
    if (auto s = w.lock()) open.push_back(std::move(s));
  for (auto& s : open) s->CloseIfIdle();
  WaitForSessions(100);
}

void HttpServer::Impl::WaitForSessions(int ticks_left) {
  sessions_.remove_if([](const std::weak_ptr<Session>& w) { return w.expired(); });
  if (sessions_.empty() || ticks_left == 0) {
    ioc_.stop();  // nothing left that would complete (or 2 s passed: abandon it)
    return;
  }
  stop_timer_.emplace(ioc_, std::chrono::milliseconds(20));
  stop_timer_->async_wait([this, ticks_left](const boost::system::error_code& e) {
    if (!e) WaitForSessions(ticks_left - 1);
  });
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HttpServer::~HttpServer() = default;

StatusOr<std::unique_ptr<HttpServer>> HttpServer::Listen(const HttpServerOptions& options, Handler handler) {
  auto impl = std::make_unique<Impl>(options, std::move(handler));
  Status s = impl->Listen();
  if (!s.ok()) return s;
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

void HttpServer::Run() { impl_->Run(); }
void HttpServer::Stop() { impl_->Stop(); }
uint16_t HttpServer::port() const { return impl_->port_; }
std::string HttpServer::url() const {
  return "http://" + impl_->host_ + ":" + std::to_string(impl_->port_) + "/";
}

}  // namespace oomguard::server
