// The MLA decode plan's short-split rule (src/cuda/mla/decode_config.hpp): plain arithmetic, checked
// without a GPU. The device plan (plan_splits) takes the larger of this count and the 128-token one,
// capped by one wave of resident CTAs; the GPU tests run whatever count it picks.
#include <gtest/gtest.h>

#include <cstdint>

#include "cuda/mla/decode_config.hpp"

namespace latentkv::cuda::mla {
namespace {

// The shapes measured on the H200 (docs/benchmarks.md, thirty-third session): glm5 tp 8 has 8 query
// rows, one row block, 32-token tiles; deepseek-v3.2 tp 1 has two row blocks of 64, 64-token tiles.
TEST(ShortSplits, MeasuredShapes) {
  EXPECT_EQ(short_split_count(1, 2048 / 32), 64);   // one 2K request: 64 splits of one tile
  EXPECT_EQ(short_split_count(1, 4096 / 32), 128);  // one 4K request: 128 of one tile
  EXPECT_EQ(short_split_count(1, 8192 / 32), 128);  // one 8K request: 128 of two tiles
  EXPECT_EQ(short_split_count(1, 16384 / 32), 0);   // 256 splits would be too many: 128-token splits
  EXPECT_EQ(short_split_count(2, 2048 / 32), 64);
  EXPECT_EQ(short_split_count(3, 2048 / 32), 32);   // 192 one-tile CTAs would not fit in 128
  EXPECT_EQ(short_split_count(8, 2048 / 32), 32);   // 256 CTAs of two tiles
  EXPECT_EQ(short_split_count(16, 2048 / 32), 0);   // 512 CTAs: 128-token splits (16)
  EXPECT_EQ(short_split_count(2, 8192 / 32), 128);
  EXPECT_EQ(short_split_count(2, 8192 / 64), 64);   // deepseek-v3.2 tp 1, one 8K request
}

// A block table of no pages (every length 0, which the validation allows) has no tiles: no short
// splits, and no division by a split count of 0 on the way (a constant expression, so this compiles
// only if none happens).
TEST(ShortSplits, NoTilesNoSplits) {
  static_assert(short_split_count(1, 0) == 0);
  static_assert(short_split_count(64, 0) == 0);
  EXPECT_EQ(short_split_count(1, 0), 0);
}

// Whatever the shape: each split holds at most kShortSplitTilesMost tiles, the request takes at most
// kShortSplitsMost splits, the grid stays within kShortSplitGrid CTAs per tile of its longest split,
// one tile a split is taken whenever it fits, and none is refused where some count would fit.
TEST(ShortSplits, BoundsHoldForEveryShape) {
  for (std::int64_t base = 1; base <= 300; ++base) {
    for (std::int64_t tiles = 1; tiles <= 600; ++tiles) {
      const std::int64_t splits = short_split_count(base, tiles);
      if (splits == 0) {  // no count of splits of at most kShortSplitTilesMost tiles fits
        for (std::int64_t n = (tiles + kShortSplitTilesMost - 1) / kShortSplitTilesMost; n <= tiles; ++n) {
          const std::int64_t longest = (tiles + n - 1) / n;
          ASSERT_FALSE(n <= kShortSplitsMost && base * n <= kShortSplitGrid * longest)
              << "base " << base << ", tiles " << tiles << ": " << n << " splits would fit";
        }
        continue;
      }
      const std::int64_t per = (tiles + splits - 1) / splits;
      ASSERT_LE(per, kShortSplitTilesMost) << "base " << base << ", tiles " << tiles;
      ASSERT_LE(splits, kShortSplitsMost) << "base " << base << ", tiles " << tiles;
      ASSERT_LE(base * splits, kShortSplitGrid * per) << "base " << base << ", tiles " << tiles;
      if (tiles <= kShortSplitsMost && base * tiles <= kShortSplitGrid) {
        ASSERT_EQ(splits, tiles) << "base " << base << ": one tile a split fits";
      }
    }
  }
}

}  // namespace
}  // namespace latentkv::cuda::mla
