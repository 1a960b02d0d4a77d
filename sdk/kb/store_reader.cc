// The read-only side of SqliteStore (store.h): connecting without creating,
// migrating or writing anything, and rereading when an immutable
// connection's file changed underneath it.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <string>

#include "sdk/kb/store.h"

namespace oomguard::kb {
namespace {

bool FileExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

// What identifies the file's contents for a reader: which file (device,
// inode: a replaced file is another one), its size and modification time,
// and whether a writer's -wal exists beside it.
std::string FileSignature(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return "-";
  return std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino) + ":" + std::to_string(st.st_size) +
         ":" + std::to_string(st.st_mtim.tv_sec) + "." + std::to_string(st.st_mtim.tv_nsec) +
         (FileExists(path + "-wal") ? ":wal" : "");
}

// An SQLite URI for `path`: characters that mean something in a URI are
// percent-encoded, and an absolute path gets an empty authority.
std::string FileUri(const std::string& path) {
  static const char* hex = "0123456789ABCDEF";
  std::string out = path.empty() || path[0] != '/' ? "file:" : "file://";
  for (unsigned char c : path) {
    if (std::isalnum(c) || c == '/' || c == '.' || c == '-' || c == '_' || c == '~') {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

// "" when `path` starts like an SQLite database, else what it is instead.
std::string NotSqliteReason(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return std::string("cannot be read: ") + std::strerror(errno);
  char head[16] = {0};
  const ssize_t n = ::read(fd, head, sizeof(head));
  ::close(fd);
  if (n == static_cast<ssize_t>(sizeof(head)) && std::memcmp(head, "SQLite format 3", 16) == 0) return "";
  return "is not an SQLite database";
}

}  // namespace

StatusOr<std::unique_ptr<Store>> SqliteStore::OpenReadOnly(const std::string& path, int busy_timeout_ms) {
  if (path.empty()) return Status::InvalidArgument("knowledge base path is empty");
  if (busy_timeout_ms < 0)
    return Status::InvalidArgument("KnowledgeBaseOptions.busy_timeout_ms must be >= 0");
  std::unique_ptr<SqliteStore> store(new SqliteStore(path, nullptr));
  store->read_only_ = true;
  store->busy_timeout_ms_ = busy_timeout_ms;
  OOMGUARD_RETURN_IF_ERROR(store->ConnectReadOnly());
  return std::unique_ptr<Store>(std::move(store));
}

Status SqliteStore::ConnectReadOnly() {
  if (db_ != nullptr) sqlite3_close_v2(db_);
  db_ = nullptr;
  const std::string where = "knowledge base " + path_;
  struct stat st {};
  if (::stat(path_.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status::NotFound(where + ": no such file");
    return Status::FailedPrecondition(where + ": " + std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) return Status::FailedPrecondition(where + " is not a regular file");
  if (st.st_size == 0)
    return Status::FailedPrecondition(where +
                                      " is empty (0 bytes), not an oomguard knowledge base (reading never "
                                      "creates one; the SDK or `oomguard kb import` does)");
  if (std::string why = NotSqliteReason(path_); !why.empty())
    return Status::DataLoss(where + " " + why + " (the file is not an oomguard knowledge base)");
  const bool wal = FileExists(path_ + "-wal");
  if (wal && !FileExists(path_ + "-shm"))
    return Status::FailedPrecondition(
        where +
        " has a -wal file but no -shm beside it (copied without it?); a "
        "reader does not create files. Copy the -shm too, or let its owner open it "
        "once with a command that writes (`oomguard kb import --db " +
        path_ + " /dev/null`)");
  // Without a -wal every committed incident is in the file itself: read it
  // as an immutable file, which needs no -wal or -shm. With one, SQLite's
  // read-only WAL reader uses the files that are there.
  immutable_ = !wal;
  signature_ = FileSignature(path_);
  const std::string uri = FileUri(path_) + (immutable_ ? "?mode=ro&immutable=1" : "?mode=ro");
  int rc = sqlite3_open_v2(uri.c_str(), &db_, SQLITE_OPEN_READONLY | SQLITE_OPEN_URI | SQLITE_OPEN_NOMUTEX,
                           nullptr);
  if (rc != SQLITE_OK) return Error(rc, "open for reading");
  sqlite3_busy_timeout(db_, busy_timeout_ms_);
  sqlite3_extended_result_codes(db_, 1);
  int version = 0;
  OOMGUARD_RETURN_IF_ERROR(ReadVersion(&version));
  if (version == 0)
    return Status::FailedPrecondition(where +
                                      " is an SQLite database but not an oomguard knowledge base (it has "
                                      "no schema_version table)");
  version_ = version;
  return Status::Ok();
}

Status SqliteStore::Reading(const std::function<void()>& read) {
  for (int attempt = 0;; ++attempt) {
    read();
    // An immutable connection trusts that nothing changes the file. When
    // something did (a writer started and checkpointed into it, or the file
    // was replaced), what it read may be torn: connect again and reread.
    if (!immutable_ || FileSignature(path_) == signature_ || attempt == 3) return Status::Ok();
    OOMGUARD_RETURN_IF_ERROR(ConnectReadOnly());
  }
}

}  // namespace oomguard::kb
