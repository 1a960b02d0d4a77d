// The guard's collectives: what ranks tell each other during one step, and
// the check that every rank is at the same collective.
//
// A StepChannel wraps a Coordinator. Each collective it runs carries its kind
// and a sequence number (the first word of every record; two status words of
// every sum); a rank that finds another rank at a different collective, or at
// the same kind with another number, returns kInternal "collective sequence
// diverged" and aborts the coordinator, so that no rank reads one collective's
// bytes as another's.
//
// The collectives of one step, in the order every rank runs them
// (docs/distributed.md has the whole protocol):
//   Vote       each rank's outcome of its local work (the commit and sync
//              fault sites included: an OOM there asks every rank to redo),
//              units, limits, memory, snapshot and durable checkpoints, and,
//              when they are small, the sync buffers themselves (Allgather)
//   Sync       the gradient buffers, each scaled by the rank's share of the
//              global batch, plus two sequence words (AllreduceSum); skipped
//              when the vote carried every rank's buffers
//   Agree      small records: after the apply, rank 0's manifest commit, a
//              restore (Allgather)
//   Reasons    why ranks stopped, as text, when some rank failed (Allgather)
//
// Fewer collectives (issue 29). Without an OOM a step runs the vote, the sum
// and the agreement: three collectives, or two when the sync buffers fit in
// the vote (at most kVoteSumWords host float32/float64 elements on every
// rank, in the same layout: a loss, a few metrics, no sync at all). Every
// rank then sums the gathered values itself, in rank order and in float64
// (what ThreadGroup does), so the result is the same on every rank. Which
// path a step takes is decided from the gathered records, the same on every
// rank, and the sequence check is the vote's tag, as on every all-gather.
// What cannot be fused without losing a guarantee:
//   - the vote into a sum of large buffers: a rank that failed before its
//     sync() has no buffers of the shape the others sum (a collective needs
//     the same shapes on every rank, and the guard cannot allocate device
//     memory for it), and each rank's scale (its units over the global
//     batch's) is known only after every rank's units are;
//   - the agreement after the apply into the next step's vote: Step would
//     return OK, and save the step's checkpoints, before it knows that every
//     rank applied; an OOM in a peer's apply would then roll back a step
//     that this rank already reported committed (and whose in-memory
//     snapshot may have replaced the one every rank holds).
//
// Thread-safety: one thread (the rank's training thread) uses a channel.
#ifndef OOMGUARD_SDK_GUARD_STEP_PROTOCOL_H_
#define OOMGUARD_SDK_GUARD_STEP_PROTOCOL_H_

#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "oomguard/coordinator.h"
#include "oomguard/status.h"

namespace oomguard::internal {

// A rank's outcome, ordered so that the maximum over ranks is what all do.
enum class VoteStatus : int64_t { kOk = 0, kRollback = 1, kFailed = 2 };

// Durable steps each rank reports in a vote (its newest ones), and in the
// points exchange of a rollback.
inline constexpr int kVoteDurable = 6;
inline constexpr int kPointsDurable = 16;

// Sync buffers of at most this many elements in all (host float32/float64)
// ride in the vote instead of a sum of their own.
inline constexpr int kVoteSumWords = 8;

// The words of one rank's vote record (the sequence tag comes on top).
inline constexpr int kVoteWords = 12 + kVoteDurable + 2 + kVoteSumWords;

// What one rank brings to the vote.
struct RankVote {
  VoteStatus status = VoteStatus::kOk;
  StatusCode code = StatusCode::kOk;  // why, when kFailed
  int64_t step = 0;                   // the step this rank is running
  int64_t units = 0;                  // loss units of this rank's share of the batch
  int64_t micro_limit = 0;
  bool had_oom = false;
  int64_t allocated = 0, reserved = 0, peak_allocated = 0;
  int64_t committed = -1;  // newest checkpoint this rank committed (rank 0 commits)
  std::optional<int64_t> snapshot;
  std::vector<int64_t> durable;  // ascending, at most kVoteDurable (the newest)
  bool redo = false;  // an OOM at the commit or sync site: every rank redoes the step
  // The sync buffers when they fit in the vote (PackSum): their layout (-1:
  // they do not fit) and their values, unscaled, as float64.
  int64_t sum_layout = -1;
  std::array<double, kVoteSumWords> sum_values{};
};

// The vote as every rank sees it.
struct VoteOutcome {
  std::vector<RankVote> ranks;  // index = rank
  VoteStatus status = VoteStatus::kOk;
  int64_t total_units = 0;
  bool units_overflow = false;        // the ranks' units do not sum within int64
  int64_t min_micro_limit = 0;
  bool any_oom = false;
  int64_t committed = -1;  // rank 0's newest committed checkpoint
  bool redo = false;       // some rank asks every rank to redo the step
  bool sum_in_vote = false;  // every rank's sync buffers are in the vote, in one layout
};

// Fills mine->sum_layout and sum_values from `buffers` when they fit in the
// vote; leaves sum_layout -1 otherwise (the step then runs Sync).
void PackSum(std::span<const SumBuffer> buffers, RankVote* mine);

// Each rank's share of the global batch: its units over the total (0 when
// the total is 0). The scale of its sync buffers, in Sync and in SumFromVote.
double ShareOf(int64_t units, int64_t total);

// When vote.sum_in_vote: writes into `buffers` (this rank's, the layout
// PackSum found) the sum over ranks of each rank's share times its values,
// accumulated in float64 in rank order: the same bits on every rank.
void SumFromVote(const VoteOutcome& vote, std::span<const SumBuffer> buffers);

// What a rank can restore: what each rank reports before a rollback, a
// resume or Finish (checkpoint_commit.h finds the steps every rank holds).
struct RankPoints {
  bool has_store = false;
  std::optional<int64_t> snapshot;
  std::vector<int64_t> durable;  // ascending, at most kPointsDurable
};

class StepChannel {
 public:
  // `coordinator` must outlive the channel. With the local coordinator every
  // collective is computed here without calling it.
  StepChannel(Coordinator* coordinator, std::chrono::milliseconds deadline);

  int rank() const { return rank_; }
  int size() const { return size_; }
  Coordinator* coordinator() const { return coordinator_; }

  StatusOr<VoteOutcome> Vote(const RankVote& mine);

  // Sums `buffers` (scales already set) over ranks, with two sequence words.
  // Every rank that calls it voted ok: nothing fails between the vote and it.
  Status Sync(std::span<const SumBuffer> buffers);

  // Every rank's `words` (the same count on every rank), index = rank.
  StatusOr<std::vector<std::vector<int64_t>>> Agree(std::span<const int64_t> words);

  // Every rank's points, index = rank.
  StatusOr<std::vector<RankPoints>> ExchangePoints(const RankPoints& mine);

  // Every rank's status code and reason text (truncated to a few hundred
  // bytes), index = rank. Ranks with nothing to report pass kOk and "".
  struct Reason {
    StatusCode code = StatusCode::kOk;
    std::string text;
  };
  StatusOr<std::vector<Reason>> ShareReasons(const Reason& mine);

 private:
  enum class Kind : int64_t { kVote = 1, kSync = 2, kAgree = 3, kPoints = 4, kReasons = 5 };
  static const char* KindName(int64_t kind);

  // One tagged allgather of `record` (the tag is prepended).
  StatusOr<std::vector<int64_t>> Gather(Kind kind, std::span<const int64_t> record);
  Status Diverged(const std::string& what);

  Coordinator* coordinator_;
  std::chrono::milliseconds deadline_;
  int rank_ = 0;
  int size_ = 1;
  bool local_ = false;   // the local coordinator: nothing to exchange
  uint64_t seq_ = 0;     // collectives run so far; the same on every rank
  std::vector<int64_t> gathered_;  // reused receive buffer
};

}  // namespace oomguard::internal

#endif  // OOMGUARD_SDK_GUARD_STEP_PROTOCOL_H_
