// Status and StatusOr<T>: how every public oomguard call reports failure.
//
// Codes follow the canonical set (as in Abseil) and carry retry meaning:
//   kResourceExhausted   out of memory that the SDK could not recover from
//   kAborted             the step was rolled back to a checkpoint; continue from there
//   kUnavailable         a peer rank did not answer within its deadline; restart all ranks
//   kDataLoss            a checkpoint or file is corrupt
//   kInvalidArgument     bad options, fault rules, files or arguments
//   kFailedPrecondition  the call is not valid in the current state
//
// Thread-safety: Status and StatusOr are values; const methods may be called
// concurrently, mutation needs external synchronisation.
#ifndef OOMGUARD_STATUS_H_
#define OOMGUARD_STATUS_H_

#include <cassert>
#include <exception>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>

#include "oomguard/export.h"

namespace oomguard {

enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
};

// "OK", "RESOURCE_EXHAUSTED", ... (the canonical spelling).
OOMGUARD_EXPORT std::string_view StatusCodeName(StatusCode code);

// (visibility spelled as an attribute here: GCC does not accept __attribute__ after [[...]].)
class [[nodiscard, gnu::visibility("default")]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message);

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string msg) { return {StatusCode::kInvalidArgument, std::move(msg)}; }
  static Status ResourceExhausted(std::string msg) { return {StatusCode::kResourceExhausted, std::move(msg)}; }
  static Status Aborted(std::string msg) { return {StatusCode::kAborted, std::move(msg)}; }
  static Status Unavailable(std::string msg) { return {StatusCode::kUnavailable, std::move(msg)}; }
  static Status DataLoss(std::string msg) { return {StatusCode::kDataLoss, std::move(msg)}; }
  static Status FailedPrecondition(std::string msg) { return {StatusCode::kFailedPrecondition, std::move(msg)}; }
  static Status NotFound(std::string msg) { return {StatusCode::kNotFound, std::move(msg)}; }
  static Status Internal(std::string msg) { return {StatusCode::kInternal, std::move(msg)}; }
  static Status Unimplemented(std::string msg) { return {StatusCode::kUnimplemented, std::move(msg)}; }
  static Status DeadlineExceeded(std::string msg) { return {StatusCode::kDeadlineExceeded, std::move(msg)}; }
  static Status Cancelled(std::string msg) { return {StatusCode::kCancelled, std::move(msg)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "RESOURCE_EXHAUSTED: message" or "OK".
  std::string ToString() const;

  bool operator==(const Status& o) const { return code_ == o.code_ && message_ == o.message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

OOMGUARD_EXPORT std::ostream& operator<<(std::ostream& os, const Status& s);

// Thrown by StatusOr<T>::value() (and *, ->) on a StatusOr that holds an
// error, in every build type: reading a value that is not there is a bug in
// the caller, and it must stop the program with the reason rather than run
// on garbage. Uncaught, the C++ runtime prints what(), which holds the
// status ("StatusOr::value() on an error: INVALID_ARGUMENT: ...").
class OOMGUARD_EXPORT BadStatusOrAccess : public std::exception {
 public:
  explicit BadStatusOrAccess(Status status);
  const char* what() const noexcept override;
  const Status& status() const { return status_; }

 private:
  Status status_;
  std::string what_;
};

namespace internal {
[[noreturn]] OOMGUARD_EXPORT void ThrowBadStatusOrAccess(const Status& status);
}  // namespace internal

// A value or a non-OK Status. Test ok() (or status()) before reading the
// value: value(), operator* and operator-> of an error throw
// BadStatusOrAccess naming the status, whatever the build type.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    assert(!status_.ok() && "StatusOr constructed from an OK Status without a value");
    if (status_.ok()) status_ = Status::Internal("StatusOr constructed from OK status without value");
  }
  StatusOr(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  const T& value() const& {
    if (!ok()) internal::ThrowBadStatusOrAccess(status_);
    return *value_;
  }
  T& value() & {
    if (!ok()) internal::ThrowBadStatusOrAccess(status_);
    return *value_;
  }
  // By value from an rvalue, so that `for (auto& x : F().value())` and
  // `auto&& v = *F();` hold the value itself, not a reference into the
  // temporary StatusOr that dies at the end of the full expression.
  T value() && {
    if (!ok()) internal::ThrowBadStatusOrAccess(status_);
    return std::move(*value_);
  }
  const T& operator*() const& { return value(); }
  T& operator*() & { return value(); }
  T operator*() && { return std::move(*this).value(); }
  const T* operator->() const { return &value(); }
  T* operator->() { return &value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace oomguard

// Returns early from the enclosing function when `expr` is not OK.
#define OOMGUARD_RETURN_IF_ERROR(expr)              \
  do {                                              \
    ::oomguard::Status _og_status = (expr);         \
    if (!_og_status.ok()) return _og_status;        \
  } while (0)

#endif  // OOMGUARD_STATUS_H_
