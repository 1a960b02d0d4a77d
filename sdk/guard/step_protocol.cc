#include "sdk/guard/step_protocol.h"

#include <algorithm>
#include <climits>
#include <cstring>

namespace oomguard::internal {
namespace {

constexpr int64_t kNoStep = INT64_MIN;
constexpr int kVoteRedo = 12 + kVoteDurable;  // then the sum's layout, then its values
constexpr int kPointsWords = 3 + kPointsDurable;
constexpr int kReasonWords = 48;

int64_t Tag(int64_t kind, uint64_t seq) {
  return (kind << 48) | static_cast<int64_t>(seq & ((uint64_t{1} << 48) - 1));
}

// The layout word of buffers that fit in the vote: their number (4 bits),
// then per buffer its count (4 bits) and whether it is float32 (1 bit).
constexpr int kLayoutBits = 5;

}  // namespace

void PackSum(std::span<const SumBuffer> buffers, RankVote* mine) {
  mine->sum_layout = -1;
  mine->sum_values.fill(0.0);
  if (buffers.size() > static_cast<size_t>(kVoteSumWords)) return;
  int64_t layout = static_cast<int64_t>(buffers.size());
  size_t at = 0;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const SumBuffer& b = buffers[i];
    // Host float memory only: the guard reads and writes it itself. Anything
    // else (device memory, int64, a bad buffer) goes through the engine,
    // which sums it or refuses it as it always did.
    if (b.device >= 0 || b.count < 0 || (b.count > 0 && b.data == nullptr) ||
        (b.dtype != DType::kFloat64 && b.dtype != DType::kFloat32) ||
        b.count > static_cast<int64_t>(kVoteSumWords) - static_cast<int64_t>(at))
      return;
    const bool f32 = b.dtype == DType::kFloat32;
    for (int64_t j = 0; j < b.count; ++j)
      mine->sum_values[at++] = f32 ? static_cast<double>(static_cast<const float*>(b.data)[j])
                                   : static_cast<const double*>(b.data)[j];
    layout |= (b.count | (f32 ? 16 : 0)) << (4 + kLayoutBits * static_cast<int>(i));
  }
  mine->sum_layout = layout;
}

double ShareOf(int64_t units, int64_t total) {
  return total > 0 ? static_cast<double>(units) / static_cast<double>(total) : 0.0;
}

void SumFromVote(const VoteOutcome& vote, std::span<const SumBuffer> buffers) {
  size_t at = 0;
  for (const SumBuffer& b : buffers) {
    for (int64_t j = 0; j < b.count; ++j, ++at) {
      double acc = 0;
      for (const RankVote& rv : vote.ranks) acc += ShareOf(rv.units, vote.total_units) * rv.sum_values[at];
      if (b.dtype == DType::kFloat32) {
        static_cast<float*>(b.data)[j] = static_cast<float>(acc);
      } else {
        static_cast<double*>(b.data)[j] = acc;
      }
    }
  }
}

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
  w[kVoteRedo] = mine.redo ? 1 : 0;
  w[kVoteRedo + 1] = mine.sum_layout;
  std::memcpy(w.data() + kVoteRedo + 2, mine.sum_values.data(), sizeof(double) * kVoteSumWords);
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
    rv.redo = v[kVoteRedo] != 0;
    rv.sum_layout = v[kVoteRedo + 1];
    std::memcpy(rv.sum_values.data(), v + kVoteRedo + 2, sizeof(double) * kVoteSumWords);
    out.status = std::max(out.status, rv.status);
    out.redo = out.redo || rv.redo;
    if (__builtin_add_overflow(out.total_units, rv.units, &out.total_units)) out.units_overflow = true;
    out.min_micro_limit = std::min(out.min_micro_limit, rv.micro_limit);
    out.any_oom = out.any_oom || rv.had_oom;
  }
  out.committed = out.ranks[0].committed;
  out.sum_in_vote = out.ranks[0].sum_layout >= 0;
  for (const RankVote& rv : out.ranks) out.sum_in_vote = out.sum_in_vote && rv.sum_layout == out.ranks[0].sum_layout;
  for (int r = 1; r < size_; ++r) {
    if (out.ranks[static_cast<size_t>(r)].step != out.ranks[0].step)
      return Diverged("rank 0 votes on step " + std::to_string(out.ranks[0].step) + ", rank " + std::to_string(r) +
                      " on step " + std::to_string(out.ranks[static_cast<size_t>(r)].step));
  }
  return out;
}

Status StepChannel::Sync(std::span<const SumBuffer> buffers) {
  const uint64_t seq = seq_++;
  std::vector<SumBuffer> all(buffers.begin(), buffers.end());
  // One rank: the sum is the buffer itself (scaled).
  if (local_) return coordinator_->AllreduceSum(all, deadline_);
  // The sequence check of a sum: sum(t) == n*t and sum(t^2) == n*t^2 hold for
  // this rank's t only when every rank contributed the same t (equality in
  // Cauchy-Schwarz). t < 2^16 keeps every sum exact in float64.
  const double t = static_cast<double>((seq & 0xffff) + 1);
  double words[2] = {t, t * t};
  all.push_back(SumBuffer::Host(words, 2));
  Status s = coordinator_->AllreduceSum(all, deadline_);
  if (!s.ok()) return s;
  const double n = static_cast<double>(size_);
  if (words[0] != n * t || words[1] != n * t * t)
    return Diverged("rank " + std::to_string(rank_) + " is at sync #" + std::to_string(seq) +
                    " but not every rank is (a sum met another collective)");
  return Status::Ok();
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
