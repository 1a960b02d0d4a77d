#include "sdk/guard/step_protocol.h"

#include <algorithm>
#include <climits>
#include <cstring>

namespace oomguard::internal {
namespace {

constexpr int64_t kNoStep = INT64_MIN;
constexpr int kVoteWords = 12 + kVoteDurable;
constexpr int kPointsWords = 3 + kPointsDurable;
constexpr int kReasonWords = 48;

int64_t Tag(int64_t kind, uint64_t seq) {
  return (kind << 48) | static_cast<int64_t>(seq & ((uint64_t{1} << 48) - 1));
}

}  // namespace

StepChannel::StepChannel(Coordinator* coordinator, std::chrono::milliseconds deadline)
    : coordinator_(coordinator),
      deadline_(deadline),
      rank_(coordinator->rank()),
      size_(coordinator->size()),
      local_(coordinator->engine() == "local" && coordinator->size() == 1) {}

const char* StepChannel::KindName(int64_t kind) {
  switch (static_cast<Kind>(kind)) {
    case Kind::kVote: return "vote";
    case Kind::kSync: return "sync";
    case Kind::kAgree: return "agreement";
    case Kind::kPoints: return "rollback points";
    case Kind::kReasons: return "reasons";
  }
  return "an unknown collective";
}

Status StepChannel::Diverged(const std::string& what) {
  coordinator_->Abort();
  return Status::Internal("collective sequence diverged: " + what +
                          " (ranks ran different collectives; the coordinator is aborted)");
}

StatusOr<std::vector<int64_t>> StepChannel::Gather(Kind kind, std::span<const int64_t> record) {
  const uint64_t seq = seq_++;
  const int64_t tag = Tag(static_cast<int64_t>(kind), seq);
  const size_t n = record.size() + 1;
  std::vector<int64_t> mine(n);
  mine[0] = tag;
  std::copy(record.begin(), record.end(), mine.begin() + 1);
  if (local_) return mine;
  gathered_.assign(n * static_cast<size_t>(size_), 0);
  Status s = coordinator_->Allgather(mine, gathered_, deadline_);
  if (!s.ok()) return s;
  for (int r = 0; r < size_; ++r) {
    const int64_t t = gathered_[static_cast<size_t>(r) * n];
    if (t != tag)
      return Diverged("rank " + std::to_string(rank_) + " is at " + KindName(static_cast<int64_t>(kind)) + " #" +
                      std::to_string(seq) + ", rank " + std::to_string(r) + " at " + KindName(t >> 48) + " #" +
                      std::to_string(t & ((int64_t{1} << 48) - 1)));
  }
  return gathered_;
}

StatusOr<VoteOutcome> StepChannel::Vote(const RankVote& mine) {
  std::vector<int64_t> w(kVoteWords, 0);
  w[0] = static_cast<int64_t>(mine.status);
  w[1] = static_cast<int64_t>(mine.code);
  w[2] = mine.step;
  w[3] = mine.units;
  w[4] = mine.micro_limit;
  w[5] = mine.had_oom ? 1 : 0;
  w[6] = mine.allocated;
  w[7] = mine.reserved;
  w[8] = mine.peak_allocated;
  w[9] = mine.snapshot ? *mine.snapshot : kNoStep;
  w[10] = mine.committed;
  const size_t nd = std::min<size_t>(mine.durable.size(), kVoteDurable);
  w[11] = static_cast<int64_t>(nd);
  std::copy(mine.durable.end() - static_cast<std::ptrdiff_t>(nd), mine.durable.end(), w.begin() + 12);
  auto all = Gather(Kind::kVote, w);
  if (!all.ok()) return all.status();
  VoteOutcome out;
  out.ranks.resize(static_cast<size_t>(size_));
  const size_t n = kVoteWords + 1;
  out.min_micro_limit = INT64_MAX;
  for (int r = 0; r < size_; ++r) {
    const int64_t* v = all->data() + static_cast<size_t>(r) * n + 1;
    RankVote& rv = out.ranks[static_cast<size_t>(r)];
    rv.status = static_cast<VoteStatus>(std::clamp<int64_t>(v[0], 0, 2));
    rv.code = static_cast<StatusCode>(v[1]);
    rv.step = v[2];
    rv.units = v[3];
    rv.micro_limit = v[4];
    rv.had_oom = v[5] != 0;
    rv.allocated = v[6];
    rv.reserved = v[7];
    rv.peak_allocated = v[8];
    if (v[9] != kNoStep) rv.snapshot = v[9];
    rv.committed = v[10];
    const int64_t k = std::clamp<int64_t>(v[11], 0, kVoteDurable);
    rv.durable.assign(v + 12, v + 12 + k);
    out.status = std::max(out.status, rv.status);
    if (__builtin_add_overflow(out.total_units, rv.units, &out.total_units)) out.units_overflow = true;
    out.min_micro_limit = std::min(out.min_micro_limit, rv.micro_limit);
    out.any_oom = out.any_oom || rv.had_oom;
  }
  out.committed = out.ranks[0].committed;
  for (int r = 1; r < size_; ++r) {
    if (out.ranks[static_cast<size_t>(r)].step != out.ranks[0].step)
      return Diverged("rank 0 votes on step " + std::to_string(out.ranks[0].step) + ", rank " + std::to_string(r) +
                      " on step " + std::to_string(out.ranks[static_cast<size_t>(r)].step));
  }
  return out;
}

StatusOr<SyncOutcome> StepChannel::Sync(std::span<const SumBuffer> buffers, SyncStatus mine) {
  const uint64_t seq = seq_++;
  // The sequence check of a sum: sum(t) == n*t and sum(t^2) == n*t^2 hold for
  // this rank's t only when every rank contributed the same t (equality in
  // Cauchy-Schwarz). t < 2^16 keeps every sum exact in float64.
  const double t = static_cast<double>((seq & 0xffff) + 1);
  double words[4] = {mine.oom ? 1.0 : 0.0, mine.error ? 1.0 : 0.0, t, t * t};
  if (local_) {
    // One rank: the sum is the buffer itself (scaled).
    std::vector<SumBuffer> all(buffers.begin(), buffers.end());
    Status s = coordinator_->AllreduceSum(all, deadline_);
    if (!s.ok()) return s;
    return SyncOutcome{mine.oom ? 1 : 0, mine.error ? 1 : 0};
  }
  std::vector<SumBuffer> all(buffers.begin(), buffers.end());
  all.push_back(SumBuffer::Host(words, 4));
  Status s = coordinator_->AllreduceSum(all, deadline_);
  if (!s.ok()) return s;
  const double n = static_cast<double>(size_);
  if (words[2] != n * t || words[3] != n * t * t)
    return Diverged("rank " + std::to_string(rank_) + " is at sync #" + std::to_string(seq) +
                    " but not every rank is (a sum met another collective)");
  return SyncOutcome{static_cast<int>(words[0]), static_cast<int>(words[1])};
}

StatusOr<std::vector<std::vector<int64_t>>> StepChannel::Agree(std::span<const int64_t> words) {
  auto all = Gather(Kind::kAgree, words);
  if (!all.ok()) return all.status();
  const size_t n = words.size() + 1;
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(local_ ? 1 : size_));
  for (size_t r = 0; r < out.size(); ++r)
    out[r].assign(all->begin() + static_cast<std::ptrdiff_t>(r * n + 1),
                  all->begin() + static_cast<std::ptrdiff_t>((r + 1) * n));
  return out;
}

StatusOr<std::vector<RankPoints>> StepChannel::ExchangePoints(const RankPoints& mine) {
  std::vector<int64_t> w(kPointsWords, 0);
  w[0] = mine.has_store ? 1 : 0;
  w[1] = mine.snapshot ? *mine.snapshot : kNoStep;
  const size_t nd = std::min<size_t>(mine.durable.size(), kPointsDurable);
  w[2] = static_cast<int64_t>(nd);
  std::copy(mine.durable.end() - static_cast<std::ptrdiff_t>(nd), mine.durable.end(), w.begin() + 3);
  auto all = Gather(Kind::kPoints, w);
  if (!all.ok()) return all.status();
  const size_t n = kPointsWords + 1;
  std::vector<RankPoints> out(static_cast<size_t>(local_ ? 1 : size_));
  for (size_t r = 0; r < out.size(); ++r) {
    const int64_t* v = all->data() + r * n + 1;
    out[r].has_store = v[0] != 0;
    if (v[1] != kNoStep) out[r].snapshot = v[1];
    const int64_t k = std::clamp<int64_t>(v[2], 0, kPointsDurable);
    out[r].durable.assign(v + 3, v + 3 + k);
  }
  return out;
}

StatusOr<std::vector<StepChannel::Reason>> StepChannel::ShareReasons(const Reason& mine) {
  constexpr size_t kMaxBytes = (kReasonWords - 2) * sizeof(int64_t);
  std::vector<int64_t> w(kReasonWords, 0);
  const size_t len = std::min(mine.text.size(), kMaxBytes);
  w[0] = static_cast<int64_t>(mine.code);
  w[1] = static_cast<int64_t>(len);
  std::memcpy(w.data() + 2, mine.text.data(), len);
  auto all = Gather(Kind::kReasons, w);
  if (!all.ok()) return all.status();
  const size_t n = kReasonWords + 1;
  std::vector<Reason> out(static_cast<size_t>(local_ ? 1 : size_));
  for (size_t r = 0; r < out.size(); ++r) {
    const int64_t* v = all->data() + r * n + 1;
    out[r].code = static_cast<StatusCode>(v[0]);
    const size_t k = static_cast<size_t>(std::clamp<int64_t>(v[1], 0, static_cast<int64_t>(kMaxBytes)));
    out[r].text.assign(reinterpret_cast<const char*>(v + 2), k);
  }
  return out;
}

}  // namespace oomguard::internal
