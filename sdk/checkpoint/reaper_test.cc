#include "sdk/checkpoint/reaper.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "sdk/checkpoint/scratch_dir.h"

namespace oomguard::ckpt {
namespace {

namespace fs = std::filesystem;

void Touch(const fs::path& p) { std::ofstream(p) << "x"; }

TEST(RemoveTree, RemovesATreeButNotWhatItsLinksPointTo) {
  ScratchDir scratch;
  const fs::path root = fs::path(scratch.path()) / "step-00000003";
  const fs::path other = fs::path(scratch.path()) / "other-run";
  fs::create_directories(root / "a" / "b");
  fs::create_directories(other);
  Touch(root / "rank-00000.h5");
  Touch(root / "a" / "b" / "deep");
  Touch(other / "MANIFEST.json");
  fs::create_directory_symlink(other, root / "a" / "link-to-dir");
  fs::create_symlink(other / "MANIFEST.json", root / "link-to-file");
  EXPECT_FALSE(RemoveTree(root.string()));
  EXPECT_FALSE(fs::exists(root));
  EXPECT_TRUE(fs::exists(other / "MANIFEST.json")) << "a link is removed, never its target";
}

TEST(RemoveTree, AMissingPathIsNoErrorAndAFileIsRemoved) {
  ScratchDir scratch;
  EXPECT_FALSE(RemoveTree(scratch.path() + "/absent"));
  Touch(scratch.path() + "/file");
  EXPECT_FALSE(RemoveTree(scratch.path() + "/file"));
  EXPECT_FALSE(fs::exists(scratch.path() + "/file"));
}

TEST(RemoveTree, RefusesDeeperThanAnyCheckpoint) {
  ScratchDir scratch;
  fs::path p = fs::path(scratch.path()) / "deep";
  for (int i = 0; i < 70; ++i) p /= "d";
  fs::create_directories(p);
  EXPECT_EQ(RemoveTree(scratch.path() + "/deep"), std::errc::too_many_symbolic_link_levels);
}

TEST(Reaper, RemovesWhatItIsHandedInTheBackground) {
  ScratchDir scratch;
  const fs::path doomed = fs::path(scratch.path()) / ".removing-step-1";
  fs::create_directories(doomed / "x");
  Touch(doomed / "x" / "f");
  Reaper reaper;
  reaper.Remove(doomed.string());
  reaper.Drain();
  EXPECT_FALSE(fs::exists(doomed));
}

}  // namespace
}  // namespace oomguard::ckpt
