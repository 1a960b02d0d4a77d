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
//   Vote       each rank's outcome of its local work, units, limits, memory,
//              snapshot and durable checkpoints (Allgather)
//   Sync       the gradient buffers, each scaled by the rank's share of the
//              global batch, plus the sync status words (AllreduceSum)
//   Agree      small records: after the apply, rank 0's manifest commit, a
//              restore (Allgather)
//   Reasons    why ranks stopped, as text, when some rank failed (Allgather)
//
// Thread-safety: one thread (the rank's training thread) uses a channel.
#ifndef OOMGUARD_SDK_GUARD_STEP_PROTOCOL_H_
#define OOMGUARD_SDK_GUARD_STEP_PROTOCOL_H_

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
};

// The status words a sum carries beside the buffers.
struct SyncStatus {
  bool oom = false;    // this rank hit an OOM at the commit or sync site
  bool error = false;  // this rank hit another error there
};
struct SyncOutcome {
  int oom_ranks = 0;
  int error_ranks = 0;
};

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

  // Sums `buffers` (scales already set) and the status words over ranks.
  StatusOr<SyncOutcome> Sync(std::span<const SumBuffer> buffers, SyncStatus mine);

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
