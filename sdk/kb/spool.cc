// Spool (spool.h): incidents on local disk while the server is away.
#include "sdk/kb/spool.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "oomguard/knowledge_base.h"
#include "sdk/kb/jsonl.h"

namespace oomguard::kb {
namespace {

bool IsSpoolName(const std::string& name) {
  return name.rfind("spool-", 0) == 0 && name.size() > 12 && name.compare(name.size() - 6, 6, ".jsonl") == 0;
}

std::vector<std::string> SpoolFiles(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = ::readdir(d))
    if (IsSpoolName(e->d_name)) out.push_back(dir + "/" + e->d_name);
  ::closedir(d);
  return out;
}

struct Spooled {
  std::vector<Incident> incidents;
  std::vector<PriorUpdate> priors;
};

std::string PriorLine(const PriorUpdate& p) {
  nlohmann::json j = {{"workload", p.workload},
                      {"micro_batch", p.micro_batch},
                      {"replace", p.replace},
                      {"learned_unix_ms", p.learned_unix_ms},
                      {"model", p.model ? nlohmann::json::parse(SizeModelToJson(*p.model)) : nlohmann::json()}};
  return nlohmann::json{{"prior", j}}.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// One line: a prior ({"prior":...}) or an incident.
Status ParseLine(const std::string& line, Spooled* out) {
  if (line.rfind("{\"prior\":", 0) != 0) {
    auto inc = IncidentFromJson(line);
    if (!inc.ok()) return inc.status();
    out->incidents.push_back(std::move(inc).value());
    return Status::Ok();
  }
  auto j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded() || !j["prior"].is_object()) return Status::InvalidArgument("a prior that does not parse");
  const auto& p = j["prior"];
  PriorUpdate u;
  try {
    u.workload = p.at("workload").get<std::string>();
    u.micro_batch = p.at("micro_batch").get<int64_t>();
    u.replace = p.at("replace").get<bool>();
    u.learned_unix_ms = p.at("learned_unix_ms").get<int64_t>();
    if (p.contains("model") && p["model"].is_object()) {
      u.model = SizeModelFromJson(p["model"].dump());
      if (!u.model) return Status::InvalidArgument("a prior's model that does not parse");
    }
  } catch (const nlohmann::json::exception& e) {
    return Status::InvalidArgument(std::string("a prior that does not parse: ") + e.what());
  }
  out->priors.push_back(std::move(u));
  return Status::Ok();
}

// Reads a spool file; a line that does not parse (torn by a crash
// mid-append) is skipped. A file that cannot be read is an error (kept for
// a later try, never emptied).
StatusOr<Spooled> ReadSpoolFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::Unavailable("spool " + path + ": cannot open: " + std::strerror(errno));
  Spooled out;
  int64_t skipped = 0;
  OOMGUARD_RETURN_IF_ERROR(ForEachJsonlLine(
      in, path, BadLine::kSkip, [&](const std::string& line) { return ParseLine(line, &out); }, &skipped));
  return out;
}

Status SendAll(const StatusOr<Spooled>& read, size_t batch, const Spool::Send& send, int64_t* sent) {
  OOMGUARD_RETURN_IF_ERROR(read.status());
  const std::vector<Incident>& all = read->incidents;
  const std::vector<PriorUpdate> none;
  for (size_t i = 0; i < all.size() || (i == 0 && !read->priors.empty()); i += batch) {
    std::vector<Incident> part(all.begin() + static_cast<std::ptrdiff_t>(std::min(all.size(), i)),
                               all.begin() + static_cast<std::ptrdiff_t>(std::min(all.size(), i + batch)));
    const bool last = i + batch >= all.size();
    OOMGUARD_RETURN_IF_ERROR(send(part, last ? read->priors : none));
    *sent += static_cast<int64_t>(part.size() + (last ? read->priors.size() : 0));
  }
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<Spool>> Spool::Open(const std::string& dir, int64_t max_bytes) {
  if (dir.empty()) return Status::InvalidArgument("spool directory is empty");
  if (max_bytes < 1) return Status::InvalidArgument("spool size limit must be >= 1 byte");
  // Made on the first Append: a job whose server never went away leaves no directory behind.
  // One that exists must be usable now, not when the server is already away.
  if (::access(dir.c_str(), F_OK) == 0 && ::access(dir.c_str(), W_OK | X_OK) != 0)
    return Status::FailedPrecondition("spool directory " + dir + " is not writable by this user");
  std::unique_ptr<Spool> spool(new Spool(dir, max_bytes));
  spool->orphans_ = spool->ScanOrphans();
  return spool;
}

Spool::~Spool() {
  if (fd_ >= 0) {
    const bool empty = pending_ == 0;
    // An empty file of ours is no use to anyone; a full one waits for adoption.
    if (empty) ::unlink(path_.c_str());
    ::close(fd_);  // releases the lock
  }
}

bool Spool::ScanOrphans() {
  for (const std::string& f : SpoolFiles(dir_)) {
    if (f == path_) continue;
    struct stat st {};
    if (::stat(f.c_str(), &st) != 0 || st.st_size == 0) continue;
    int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    const bool free = ::flock(fd, LOCK_EX | LOCK_NB) == 0;
    ::close(fd);
    if (free) return true;
  }
  return false;
}

int64_t Spool::DirBytes() const {
  int64_t total = 0;
  for (const std::string& f : SpoolFiles(dir_)) {
    struct stat st {};
    if (::stat(f.c_str(), &st) == 0) total += st.st_size;
  }
  return total;
}

Status Spool::EnsureFile() {
  if (fd_ >= 0) return Status::Ok();
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) return Status::Unavailable("spool directory " + dir_ + ": " + ec.message());
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  for (char* c = host; *c; ++c)
    if (*c == '/' || *c == ' ') *c = '_';
  std::random_device rd;
  char tag[17];
  std::snprintf(tag, sizeof(tag), "%08x%08x", rd(), rd());
  const std::string path = dir_ + "/spool-" + host + "-" + std::to_string(::getpid()) + "-" + tag + ".jsonl";
  int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_APPEND | O_CLOEXEC, 0600);
  if (fd < 0) return Status::Unavailable("spool " + path + ": " + std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd);
    return Status::Unavailable("spool " + path + ": cannot lock it");
  }
  fd_ = fd;
  path_ = path;
  return Status::Ok();
}

Status Spool::Append(const std::vector<Incident>& incidents, const std::vector<PriorUpdate>& priors) {
  if (incidents.empty() && priors.empty()) return Status::Ok();
  std::string text;
  for (const Incident& inc : incidents) {
    text += IncidentToJson(inc);
    text += '\n';
  }
  for (const PriorUpdate& p : priors) {
    text += PriorLine(p);
    text += '\n';
  }
  if (DirBytes() + static_cast<int64_t>(text.size()) > max_bytes_)
    return Status::ResourceExhausted("spool " + dir_ + " is full (" + std::to_string(max_bytes_) +
                                     " bytes); incidents dropped until the server is back");
  OOMGUARD_RETURN_IF_ERROR(EnsureFile());
  for (size_t done = 0; done < text.size();) {
    ssize_t n = ::write(fd_, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::Unavailable("spool " + path_ + ": write: " + std::strerror(errno));
    done += static_cast<size_t>(n);
  }
  if (::fdatasync(fd_) != 0) return Status::Unavailable("spool " + path_ + ": sync: " + std::strerror(errno));
  pending_ += static_cast<int64_t>(incidents.size() + priors.size());
  return Status::Ok();
}

Status Spool::Drain(const Send& send, size_t batch, int64_t* sent) {
  *sent = 0;
  if (batch == 0) batch = 1;
  if (pending_ > 0) {
    OOMGUARD_RETURN_IF_ERROR(SendAll(ReadSpoolFile(path_), batch, send, sent));
    if (::ftruncate(fd_, 0) != 0) return Status::Unavailable("spool " + path_ + ": truncate: " + std::strerror(errno));
    pending_ = 0;
  }
  for (const std::string& f : SpoolFiles(dir_)) {
    if (f == path_) continue;
    int fd = ::open(f.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) continue;
    // Held: its process lives (and sends it itself). Taken: adopted.
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      ::close(fd);
      continue;
    }
    // Still the file under that name (not removed by another adopter meanwhile)?
    struct stat a {}, b {};
    if (::fstat(fd, &a) != 0 || ::stat(f.c_str(), &b) != 0 || a.st_ino != b.st_ino || a.st_dev != b.st_dev) {
      ::close(fd);
      continue;
    }
    Status s = SendAll(ReadSpoolFile(f), batch, send, sent);
    if (s.ok()) ::unlink(f.c_str());
    ::close(fd);
    OOMGUARD_RETURN_IF_ERROR(s);
  }
  orphans_ = false;
  return Status::Ok();
}

}  // namespace oomguard::kb
