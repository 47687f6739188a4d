// Which GPUs a build's architecture list runs on (src/cuda/common/arch_list.hpp): what the CUDA
// backends refuse up front (select(), `latentkv config`) rather than fail at their first launch.
#include <gtest/gtest.h>

#include "cuda/common/arch_list.hpp"

namespace {

using latentkv::cuda::arch_list_runs_on;

TEST(ArchList, PlainEntriesHoldCodeForTheMajorAndPtxForLaterGpus) {
  EXPECT_TRUE(arch_list_runs_on("89", 89));
  EXPECT_TRUE(arch_list_runs_on("89", 90));   // the PTX, compiled for sm_90
  EXPECT_TRUE(arch_list_runs_on("89", 120));
  EXPECT_FALSE(arch_list_runs_on("89", 86));  // older than the code
  EXPECT_TRUE(arch_list_runs_on("80-real", 86));  // code of 8.0 runs on later minors of 8.x
  EXPECT_FALSE(arch_list_runs_on("89-real", 90));
  EXPECT_TRUE(arch_list_runs_on("89-virtual", 120));
}

// "a" entries run on their architecture alone, code or PTX (its features exist nowhere else); "f"
// entries on their family, whatever the suffix.
TEST(ArchList, ArchitectureAndFamilyEntries) {
  for (const char* entry : {"90a", "90a-real", "90a-virtual"}) {
    EXPECT_TRUE(arch_list_runs_on(entry, 90)) << entry;
    EXPECT_FALSE(arch_list_runs_on(entry, 100)) << entry;
    EXPECT_FALSE(arch_list_runs_on(entry, 120)) << entry;
  }
  for (const char* entry : {"100f", "100f-real", "100f-virtual"}) {
    EXPECT_TRUE(arch_list_runs_on(entry, 100)) << entry;
    EXPECT_TRUE(arch_list_runs_on(entry, 103)) << entry;
    EXPECT_FALSE(arch_list_runs_on(entry, 120)) << entry;
    EXPECT_FALSE(arch_list_runs_on(entry, 90)) << entry;
  }
}

TEST(ArchList, ListsAsCMakeAndTheBuildWriteThem) {
  EXPECT_TRUE(arch_list_runs_on("89;90a;100a;120a", 120));
  EXPECT_TRUE(arch_list_runs_on("89,90a,100a,120a", 100));
  EXPECT_FALSE(arch_list_runs_on("90a,100a", 89));
  EXPECT_FALSE(arch_list_runs_on("90a,100a", 103));
  EXPECT_TRUE(arch_list_runs_on("90a;native", 75));  // resolved by CMake: not known here
  EXPECT_FALSE(arch_list_runs_on("", 90));
  EXPECT_FALSE(arch_list_runs_on("90b,90x-real", 90));  // not entries CMake takes
}

}  // namespace
