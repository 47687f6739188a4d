// The arithmetic of `latentkv step` (tools/step_report.*): what each op must move and compute, the
// floors, shares, gaps and tokens per second derived from measured times, the tables, the JSON
// round trip that --from-json relies on; and the top-k check the GPU run applies before timing
// (tools/step_check.hpp).
#include "step_report.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "step_check.hpp"
#include "support/text_lines.hpp"

namespace latentkv::tools {
namespace {

using latentkv::testing::words_of_line;

// glm5 at tp 8 (SPEC section 2): the yardstick shape of the step issue.
StepShape glm5_b1_32k() {
  StepShape s;
  s.model = "glm5";
  s.tp = 8;
  s.layers = 78;
  s.model_layers = 78;
  s.heads = 8;
  s.indexer_heads = 32;
  s.topk = 2048;
  s.batch = 1;
  s.context = 32768;
  s.q_len = 1;
  s.pool_tokens = 495040;  // 495000 rounded up to pages of 64
  s.page_size = 64;
  return s;
}

// q [H, 576] bf16 in, o [H, 512] bf16 and lse [H] f32 out, per query row.
double q_o_lse(const StepShape& s) { return s.heads * (576 * 2 + 512 * 2 + 4.0); }

TEST(StepWork, VisibleTokensAreCausalAmongTheNewOnes) {
  StepShape s = glm5_b1_32k();
  s.context = 100;
  s.q_len = 3;
  EXPECT_EQ(s.visible(0), 98);
  EXPECT_EQ(s.visible(2), 100);
  s.context = 2048;
  EXPECT_TRUE(s.dense_is_exact());  // every row sees <= index_topk tokens
  s.context = 2049;
  EXPECT_FALSE(s.dense_is_exact());
}

TEST(StepWork, SparseDecodeMovesTheSelectedTokensOnce) {
  const StepShape s = glm5_b1_32k();
  const OpWork w = op_work(StepOp::kSparseDecode, "cuda", s);
  EXPECT_DOUBLE_EQ(w.bytes, 2048 * 656.0 + q_o_lse(s) + 2048 * 4.0);
  EXPECT_DOUBLE_EQ(w.floor_bytes, w.bytes);
  EXPECT_DOUBLE_EQ(w.flops, 2.0 * 8 * (576 + 512) * 2048);
  // Four rows of a request each select 2048 of its entries: the floor reads at least the largest
  // row's selection once (the rows overlap; the top-k picks them on the GPU), and every selection
  // is attended.
  StepShape four = glm5_b1_32k();
  four.batch = 2;
  four.context = 3000;
  four.q_len = 4;
  const OpWork rows = op_work(StepOp::kSparseDecode, "cuda", four);
  EXPECT_DOUBLE_EQ(rows.floor_bytes, 2 * (2048 * 656.0 + 4 * q_o_lse(four) + 4 * 2048 * 4.0));
  four.context = 1000;  // short rows: the last one sees 1000 tokens
  EXPECT_DOUBLE_EQ(op_work(StepOp::kSparseDecode, "cuda", four).floor_bytes,
                   2 * (1000 * 656.0 + 4 * q_o_lse(four) + 4 * 2048 * 4.0));
  four.context = 3000;
  EXPECT_DOUBLE_EQ(rows.flops, 2 * 4 * 2.0 * 8 * (576 + 512) * 2048);
  // gather_cast moves each row's selection.
  EXPECT_DOUBLE_EQ(op_work(StepOp::kSparseDecode, "gather_cast", four).bytes,
                   2 * (4 * 2048 * (656.0 + 2 * 1152) + 4 * q_o_lse(four) + 4 * 2048 * 4.0));
}

TEST(StepWork, TheCastBaselinesMoveMoreButShareTheFloor) {
  const StepShape s = glm5_b1_32k();
  const OpWork fp8 = op_work(StepOp::kSparseDecode, "cuda", s);
  const OpWork full = op_work(StepOp::kSparseDecode, "cast_full", s);
  const OpWork gather = op_work(StepOp::kSparseDecode, "gather_cast", s);
  // cast_full reads 656 B and writes 1152 B for every slot of the pool, then reads 1152 B per token.
  EXPECT_DOUBLE_EQ(full.bytes, 495040 * (656.0 + 1152) + 2048 * 1152.0 + q_o_lse(s) + 2048 * 4.0);
  EXPECT_NEAR(full.bytes / 1e9, 0.897, 0.001);  // SPEC section 1: about 0.86 GB a layer (without the decode)
  EXPECT_DOUBLE_EQ(gather.bytes, 2048 * (656.0 + 2 * 1152) + q_o_lse(s) + 2048 * 4.0);
  for (const OpWork& w : {full, gather}) {
    EXPECT_DOUBLE_EQ(w.floor_bytes, fp8.floor_bytes);
    EXPECT_DOUBLE_EQ(w.flops, fp8.flops);
  }
  // The ops before the decode do not depend on the decode backend.
  EXPECT_DOUBLE_EQ(op_work(StepOp::kIndexerLogits, "cast_full", s).bytes,
                   op_work(StepOp::kIndexerLogits, "cuda", s).bytes);
}

TEST(StepWork, CastFullCastsThePoolThenReadsWhatItAttends) {
  // Sparse at q_len 4: the pool cast, then every row's 2048 selected tokens read back as bf16.
  StepShape four = glm5_b1_32k();
  four.batch = 2;
  four.context = 3000;
  four.q_len = 4;
  EXPECT_DOUBLE_EQ(op_work(StepOp::kSparseDecode, "cast_full", four).bytes,
                   495040 * (656.0 + 1152) + 2 * 4 * 2048 * 1152.0 + 8 * q_o_lse(four) + 8 * 2048 * 4.0);
  // Dense: the pool cast, then each request's L tokens read once as bf16 (its q_len rows share them).
  StepShape s = glm5_b1_32k();
  s.batch = 64;
  s.context = 8192;
  s.q_len = 2;
  const OpWork dense = op_work(StepOp::kDenseDecode, "cast_full", s);
  EXPECT_DOUBLE_EQ(dense.bytes, 495040 * (656.0 + 1152) + 64 * 8192 * 1152.0 + 128 * q_o_lse(s));
  EXPECT_DOUBLE_EQ(dense.floor_bytes, 64 * 8192 * 656.0 + 128 * q_o_lse(s));
}

TEST(StepWork, DenseDecodeReadsEveryVisibleToken) {
  StepShape s = glm5_b1_32k();
  s.batch = 64;
  s.context = 8192;
  const OpWork w = op_work(StepOp::kDenseDecode, "cuda", s);
  EXPECT_DOUBLE_EQ(w.bytes, 64 * (8192 * 656.0 + q_o_lse(s)));
  EXPECT_DOUBLE_EQ(w.flops, 64 * 2.0 * 8 * 1088 * 8192);
  const OpWork gather = op_work(StepOp::kDenseDecode, "gather_cast", s);
  EXPECT_DOUBLE_EQ(gather.bytes, 64 * 8192 * (656.0 + 1152) + 64 * (8192 * 1152.0 + q_o_lse(s)));
  // With q_len 2 the two rows share the request's tokens: read once, attended twice.
  s.q_len = 2;
  const OpWork two = op_work(StepOp::kDenseDecode, "cuda", s);
  EXPECT_DOUBLE_EQ(two.bytes, 64 * 8192 * 656.0 + 128 * q_o_lse(s));
  EXPECT_DOUBLE_EQ(two.flops, 64 * 2.0 * 8 * 1088 * (8191 + 8192));
  EXPECT_DOUBLE_EQ(op_work(StepOp::kDenseDecode, "gather_cast", s).bytes,
                   64 * 8192 * (656.0 + 2 * 1152) + 128 * q_o_lse(s));
}

TEST(StepWork, IndexerTopkAndAppend) {
  StepShape s = glm5_b1_32k();
  s.batch = 2;
  s.context = 1000;
  s.q_len = 2;
  const double visible = 2 * (999.0 + 1000.0);  // two requests, rows seeing 999 and 1000 tokens
  const OpWork idx = op_work(StepOp::kIndexerLogits, "cuda", s);
  EXPECT_DOUBLE_EQ(idx.bytes, 2 * 1000 * 132.0 + 4 * 32 * (128 + 4.0) + 4 * visible);
  EXPECT_DOUBLE_EQ(idx.flops, 2.0 * 32 * 128 * visible);
  EXPECT_DOUBLE_EQ(op_work(StepOp::kTopk, "cuda", s).bytes, 4 * visible + 4 * 2048 * 4.0);
  EXPECT_DOUBLE_EQ(op_work(StepOp::kTopk, "cuda", s).flops, 0);
  // Four new tokens: bf16 latent, key and an i32 slot in; 656 + 132 bytes out.
  EXPECT_DOUBLE_EQ(op_work(StepOp::kAppend, "cuda", s).bytes, 4 * (1152 + 256 + 4 + 656 + 132.0));
}

TEST(StepWork, AStepSmallerThanTwiceTheL2IsSaidToReadPartlyFromIt) {
  StepShape s = glm5_b1_32k();
  const double per_layer = op_work(StepOp::kAppend, "cuda", s).floor_bytes +
                           op_work(StepOp::kIndexerLogits, "cuda", s).floor_bytes +
                           op_work(StepOp::kTopk, "cuda", s).floor_bytes +
                           op_work(StepOp::kSparseDecode, "cuda", s).floor_bytes;
  EXPECT_DOUBLE_EQ(step_floor_bytes(s), 78 * per_layer);
  const double l2 = 60e6;
  EXPECT_EQ(l2_residency_note(s, l2), "");  // 78 layers: about 450 MB
  s.layers = 1;                             // about 6 MB
  const std::string note = l2_residency_note(s, l2);
  EXPECT_NE(note.find("an FP8-native step moves 5.97 MB, less than twice the L2 (60 MB)"), std::string::npos) << note;
  EXPECT_EQ(l2_residency_note(s, 0), "");  // the L2's size unknown
  // One layer moves 2200 + 4,460,672 + 139,264 + 1,369,120 = 5,971,256 B: under twice 3 MB, not twice 2.9 MB.
  EXPECT_NE(l2_residency_note(s, 3e6).find("moves 5.97 MB, less than twice the L2 (3 MB)"), std::string::npos);
  EXPECT_EQ(l2_residency_note(s, 2.9e6), "");
  s.context = 1000;                         // the model's rule: dense decode, every token read
  s.layers = 2;
  EXPECT_DOUBLE_EQ(step_floor_bytes(s), 2 * (op_work(StepOp::kAppend, "cuda", s).floor_bytes +
                                             op_work(StepOp::kDenseDecode, "cuda", s).floor_bytes));
  // 1,010,000 B is 1.01 MB, not 1010 kB: 2 x (2200 + 1000 x 656 + 8 x 2180) = 1,351,280 B is 1.35 MB.
  EXPECT_NE(l2_residency_note(s, 1.01e6).find("moves 1.35 MB, less than twice the L2 (1.01 MB)"), std::string::npos)
      << l2_residency_note(s, 1.01e6);
}

TEST(StepWork, FloorIsTheSlowerOfBandwidthAndCompute) {
  const OpWork memory{4e6, 4e6, 1e6};                  // 4 MB, 1 MFLOP
  const OpWork compute{1e3, 1e3, 1e12};                // 1 TFLOP
  EXPECT_DOUBLE_EQ(floor_us(memory, 4000, 800), 1.0);  // 4e6 B / 4000 GB/s = 1 us
  EXPECT_DOUBLE_EQ(floor_us(compute, 4000, 800), 1250.0);
  EXPECT_DOUBLE_EQ(floor_us(memory, 0, 800), 1e6 / 800e6);
  EXPECT_DOUBLE_EQ(floor_us(memory, 0, 0), 0.0);  // nothing measured: no floor
  EXPECT_DOUBLE_EQ(floor_us(memory, 4000, 800, 39.0), 39.0);  // 78 layers x 0.5 us of dependent launches
  EXPECT_DOUBLE_EQ(floor_us(compute, 4000, 800, 39.0), 1250.0);
}

// A measured report of two strategies, as the GPU run fills it (times only).
StepReport measured_report() {
  StepReport r;
  r.command = "latentkv step --batch 1";
  r.device = "NVIDIA H200 (sm_90, 132 SMs)";
  r.shape = glm5_b1_32k();
  r.read_gbps = 4490;
  r.copy_gbps = 4250;
  r.matrix_tflops = 766;
  r.matrix_how = "cuBLAS bf16 GEMM 8192^3, fp32 accumulate, median of 10";
  r.warmup = 3;
  r.iters = 20;
  r.seed = 7;
  const auto strategy = [](std::string name, std::string backend, double step, std::vector<double> ops) {
    StrategyResult s;
    s.name = std::move(name);
    s.backend = std::move(backend);
    s.status = "pass";
    s.timed = true;
    s.step_us = step;
    s.step_p10_us = step * 0.99;
    s.step_p90_us = step * 1.01;
    const std::vector<StepOp> kinds = step_ops(false);
    for (std::size_t i = 0; i < kinds.size(); ++i) {
      OpResult op;
      op.op = kinds[i];
      op.backend = i == 3 ? s.backend : "cuda";
      op.kernel = "k" + std::to_string(i);
      op.us = ops[i];
      op.p10_us = ops[i];
      op.p90_us = ops[i];
      s.ops.push_back(op);
    }
    return s;
  };
  r.strategies.push_back(strategy("fp8", "cuda", 1000, {100, 300, 200, 350}));
  r.strategies.push_back(strategy("cast_full", "cast_full", 80000, {100, 300, 200, 79000}));
  StrategyResult failed;
  failed.name = "gather_cast";
  failed.backend = "gather_cast";
  failed.status = "FAIL: o 3 of 8 out of tolerance";
  failed.ops = r.strategies[0].ops;
  r.strategies.push_back(failed);
  return r;
}

TEST(StepAnalysis, SharesRatesGapsAndTokensPerSecond) {
  StepReport r = measured_report();
  analyze_step(r);
  const StrategyResult& fp8 = r.strategies[0];
  EXPECT_DOUBLE_EQ(fp8.ops_us, 950);
  EXPECT_DOUBLE_EQ(fp8.tokens_per_s_stream, 1000.0);  // 1 ms a step, one token a step
  EXPECT_DOUBLE_EQ(fp8.tokens_per_s_batch, 1000.0);
  EXPECT_DOUBLE_EQ(fp8.speedup_vs_cast_full, 80.0);
  EXPECT_DOUBLE_EQ(r.strategies[1].speedup_vs_cast_full, 1.0);

  const OpResult& sparse = fp8.ops[3];
  const OpWork one = op_work(StepOp::kSparseDecode, "cuda", r.shape);
  EXPECT_DOUBLE_EQ(sparse.work.bytes, 78 * one.bytes);  // summed over the layers
  EXPECT_DOUBLE_EQ(sparse.share, 0.35);
  EXPECT_DOUBLE_EQ(sparse.gbps, 78 * one.bytes / (350 * 1e3));
  EXPECT_DOUBLE_EQ(sparse.pct_of_copy, 100 * sparse.gbps / 4250);
  EXPECT_DOUBLE_EQ(sparse.tflops, 78 * one.flops / (350 * 1e6));
  EXPECT_DOUBLE_EQ(sparse.floor_us, floor_us(sparse.work, 4250, 766));
  EXPECT_DOUBLE_EQ(sparse.gap, 350 / sparse.floor_us);
  double floor = 0;
  for (const OpResult& op : fp8.ops) floor += op.floor_us;
  EXPECT_DOUBLE_EQ(fp8.floor_us, floor);
  EXPECT_DOUBLE_EQ(fp8.gap, 1000 / floor);

  // The cast_full decode moves the pool every layer, but its floor is the FP8-native op's.
  const OpResult& cast = r.strategies[1].ops[3];
  EXPECT_GT(cast.work.bytes, 100 * sparse.work.bytes);
  EXPECT_DOUBLE_EQ(cast.floor_us, sparse.floor_us);

  // A failed strategy gets no rates, no gap and no speed-up.
  const StrategyResult& failed = r.strategies[2];
  EXPECT_EQ(failed.tokens_per_s_stream, 0);
  EXPECT_EQ(failed.speedup_vs_cast_full, 0);
  for (const OpResult& op : failed.ops) {
    EXPECT_EQ(op.gbps, 0);
    EXPECT_EQ(op.gap, 0);
  }
}

// The speed-up is over the cast_full backend on the path the model's rule picks, whatever name ran
// it: sparse_cast_full listed before cast_full runs it (and cast_full is then left out), while
// dense_cast_full at a context the rule runs sparse is not what engines run, and is no yardstick.
TEST(StepAnalysis, SpeedUpOverCastFullByWhatRanNotByName) {
  StepReport r = measured_report();  // 32K: the rule picks sparse
  ASSERT_FALSE(r.shape.dense_is_exact());
  r.strategies[1].name = "sparse_cast_full";
  analyze_step(r);
  EXPECT_DOUBLE_EQ(r.strategies[0].speedup_vs_cast_full, 80.0);

  r = measured_report();
  r.strategies[1].name = "dense_cast_full";
  r.strategies[1].dense = true;
  analyze_step(r);
  EXPECT_EQ(r.strategies[0].speedup_vs_cast_full, 0);
  EXPECT_EQ(r.strategies[1].speedup_vs_cast_full, 0);
}

TEST(StepAnalysis, EveryOpOfEveryLayerCostsAtLeastOneChainedLaunch) {
  StepReport r = measured_report();
  r.launch_us = 0.5;
  analyze_step(r);
  const StrategyResult& fp8 = r.strategies[0];
  // The append moves a few kilobytes a layer: its floor is 78 dependent launches of 0.5 us.
  const OpResult& append = fp8.ops[0];
  EXPECT_DOUBLE_EQ(append.floor_us, 39.0);
  EXPECT_DOUBLE_EQ(append.gap, 100 / 39.0);
  // The sparse decode is still bound by its bytes at one request (78 x 1.37 MB at 4250 GB/s: 25 us)
  // only if that exceeds the launches; here 39 us of launches are the larger floor.
  const OpResult& sparse = fp8.ops[3];
  EXPECT_DOUBLE_EQ(sparse.floor_us, std::max(39.0, floor_us(sparse.work, 4250, 766)));
  double floor = 0;
  for (const OpResult& op : fp8.ops) floor += op.floor_us;
  EXPECT_DOUBLE_EQ(fp8.floor_us, floor);
  const std::string text = format_report(r);
  EXPECT_NE(text.find("one chained launch 0.50 us"), std::string::npos) << text;
}

TEST(StepAnalysis, RatesCountWhatTheStrategyMovesAgainstTheirOwnCeiling) {
  StepReport r = measured_report();
  analyze_step(r);
  // fp8's sparse decode: 78 x 2 x 8 heads x (576 + 512) x 2048 FLOP in 350 us, against 766 TFLOP/s.
  EXPECT_DOUBLE_EQ(r.strategies[0].ops[3].pct_of_matrix, 100.0 * (78 * 2.0 * 8 * (576 + 512) * 2048 / 350e6) / 766);
  // cast_full's decode: its GB/s counts the pool it casts every layer, not the floor's bytes.
  const OpResult& cast = r.strategies[1].ops[3];
  const double cast_layer = 495040 * (656.0 + 1152) + 2048 * 1152.0 + q_o_lse(r.shape) + 2048 * 4.0;
  EXPECT_DOUBLE_EQ(cast.gbps, 78 * cast_layer / (79000 * 1e3));
  EXPECT_DOUBLE_EQ(cast.pct_of_copy, 100 * (78 * cast_layer / (79000 * 1e3)) / 4250);
}

TEST(StepAnalysis, QLenCountsEveryNewTokenAndTheBatchMultiplies) {
  StepReport r = measured_report();
  r.shape.q_len = 2;
  r.shape.batch = 4;
  analyze_step(r);
  EXPECT_DOUBLE_EQ(r.strategies[0].tokens_per_s_stream, 2000.0);
  EXPECT_DOUBLE_EQ(r.strategies[0].tokens_per_s_batch, 8000.0);
}

TEST(StepAnalysis, WithoutCeilingsThereAreNoFloors) {
  StepReport r = measured_report();
  r.copy_gbps = r.read_gbps = r.matrix_tflops = 0;
  r.cpu_reference = true;
  analyze_step(r);
  for (const OpResult& op : r.strategies[0].ops) {
    EXPECT_EQ(op.floor_us, 0);
    EXPECT_EQ(op.gap, 0);
    EXPECT_EQ(op.pct_of_copy, 0);
    EXPECT_GT(op.gbps, 0);
  }
  const std::string text = format_report(r);
  EXPECT_NE(text.find("floors: none measured"), std::string::npos) << text;
  EXPECT_NE(text.find("step ms"), std::string::npos) << text;  // the CPU reference's times are in ms
}

// The CPU reference's tables leave out the columns only a GPU run fills; a GPU run's keep them.
TEST(StepReportText, TheCpuReferencesTablesHoldOnlyItsColumns) {
  StepReport r = measured_report();
  r.copy_gbps = r.read_gbps = r.matrix_tflops = 0;
  r.cpu_reference = true;
  analyze_step(r);
  const std::string text = format_report(r);
  EXPECT_EQ(words_of_line(text, "strategy "),
            (std::vector<std::string>{"strategy", "path", "decode", "step", "ms", "p10..p90", "ms", "tok/s/stream", "check"}))
      << text;
  EXPECT_EQ(words_of_line(text, "  op "), (std::vector<std::string>{"op", "ms/step", "share", "moved", "GB/s", "TFLOP/s",
                                                                    "kernel"}))
      << text;
  const std::vector<std::string> indexer = words_of_line(text, "  indexer_logits ");
  ASSERT_EQ(indexer.size(), 8u) << text;  // op, ms, share, moved (2 words), GB/s, TFLOP/s, kernel
  EXPECT_EQ(indexer.back(), r.strategies[0].ops[1].kernel) << text;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("repro: ", 0) != 0 && line.rfind("model's rule: ", 0) != 0) EXPECT_LE(line.size(), 130u) << line;
  }

  StepReport gpu = measured_report();
  analyze_step(gpu);
  EXPECT_EQ(words_of_line(format_report(gpu), "  op ").size(), 15u);  // "% copy", "% bf16", "floor us": 2 words each
}

TEST(StepReportText, TablesNameTheFloorsAndEveryStrategy) {
  StepReport r = measured_report();
  r.notes.push_back("a note");
  analyze_step(r);
  const std::string text = format_report(r);
  for (const char* want :
       {"copy 4250 GB/s", "bf16 matrix 766 TFLOP/s", "note: a note", "sparse_decode", "indexer_logits", "80.0x",
        "FAIL: o 3 of 8", "repro: latentkv step --batch 1", "between ops"}) {
    EXPECT_NE(text.find(want), std::string::npos) << "missing '" << want << "' in\n" << text;
  }
  EXPECT_NE(text.find("sparse decode"), std::string::npos) << "the model's rule at 32K is sparse:\n" << text;
  EXPECT_EQ(text.find("a kernel waiting for the one before it"), std::string::npos) << "none measured:\n" << text;
}

TEST(StepReportText, EachColumnShowsItsOwnFigure) {
  StepReport r = measured_report();
  analyze_step(r);
  const std::string text = format_report(r);
  // fp8's floor: append 78 x 2200 B, indexer 78 x 4,460,672 B, top-k 78 x 139,264 B, sparse decode
  // 78 x 1,369,120 B at 4250 GB/s (each above its FLOPs at 766 TFLOP/s): 0.04 + 81.87 + 2.56 + 25.13
  // = 109.6 us; gap 1000 / 109.6 = 9.1x; cast_full 80000 / 1000 = 80.0x.
  EXPECT_EQ(words_of_line(text, "fp8 "),
            (std::vector<std::string>{"fp8", "sparse", "cuda", "1000.0", "990.0..1010.0", "1000.0", "109.6", "9.1x",
                                      "80.0x", "pass"}));
  // fp8's sparse decode, 350 us of a 1000 us step: 35.0%; moves 78 x 1,369,120 B = 107 MB; 107 MB / 350 us =
  // 305 GB/s, 7.2% of 4250; 78 x 2 x 8 x 1088 x 2048 FLOP / 350 us = 7.95 TFLOP/s, 1.0% of 766;
  // floor 107 MB / 4250 GB/s = 25.1 us, gap 350 / 25.13 = 13.9x.
  EXPECT_EQ(words_of_line(text, "  sparse_decode "),
            (std::vector<std::string>{"sparse_decode", "350.0", "35.0%", "107", "MB", "305", "7.2%", "7.95", "1.0%",
                                      "25.1", "13.9x", "-", "k3"}));
  // 1000 us over 78 layers is 12.8 us a layer.
  EXPECT_NE(text.find("fp8 (sparse, decode backend cuda): step 1000.0 us, 78 layers of 12.8 us;"), std::string::npos)
      << text;
  // Between ops: 1000 - (100 + 300 + 200 + 350) = +50 us, 5.0% of the step.
  const std::vector<std::string> between = words_of_line(text, "  between ops ");
  ASSERT_GE(between.size(), 4u);
  EXPECT_EQ(between[2], "+50.0");
  EXPECT_EQ(between[3], "5.0%");
  // Ops that sum to more than the step: 900 - 950 = -50 us, -5.6% of 900.
  r.strategies[0].step_us = 900;
  analyze_step(r);
  const std::vector<std::string> negative = words_of_line(format_report(r), "  between ops ");
  ASSERT_GE(negative.size(), 4u);
  EXPECT_EQ(negative[2], "-50.0");
  EXPECT_EQ(negative[3], "-5.6%");
}

TEST(StepReportText, TokensPerSecondOfTheBatchMultiplyTheStreams) {
  StepReport r = measured_report();
  r.shape.batch = 4;
  analyze_step(r);
  // One token a 1000 us step: 1000 tokens/s for one stream, 4 x 1000 for the batch of 4.
  const std::string text = format_report(r);
  EXPECT_NE(text.find("; 1000.0 tokens/s for one stream, 4000.0 for the batch\n"), std::string::npos) << text;
}

TEST(StepReportText, DenseBeyondIndexTopkIsMarkedAComparison) {
  StepReport r = measured_report();
  StrategyResult dense;
  dense.name = "dense";
  dense.dense = true;
  dense.backend = "cuda";
  dense.status = "pass";
  dense.timed = true;
  dense.step_us = dense.step_p10_us = dense.step_p90_us = 2000;
  for (const StepOp kind : step_ops(true)) {
    OpResult op;
    op.op = kind;
    op.backend = "cuda";
    op.us = op.p10_us = op.p90_us = 1000;
    dense.ops.push_back(op);
  }
  r.strategies.push_back(dense);
  analyze_step(r);
  std::string text = format_report(r);  // L = 32768 > index_topk 2048: not the model's attention
  EXPECT_EQ(words_of_line(text, "dense ").at(1), "dense*");
  EXPECT_NE(text.find("\ndense*: every visible token"), std::string::npos) << text;
  r.shape.context = 2048;  // every row sees <= index_topk: dense is exact
  analyze_step(r);
  text = format_report(r);
  EXPECT_EQ(words_of_line(text, "dense ").at(1), "dense");
  EXPECT_EQ(text.find("dense*"), std::string::npos) << text;
}

TEST(StepReportText, ALaunchFloorAloneIsAFloor) {
  StepReport r = measured_report();
  r.copy_gbps = r.read_gbps = r.matrix_tflops = 0;
  r.launch_us = 0.5;
  analyze_step(r);
  const std::string text = format_report(r);
  EXPECT_EQ(text.find("floors: none measured"), std::string::npos) << text;
  EXPECT_NE(text.find("one chained launch 0.50 us"), std::string::npos) << text;
  // Four ops of 78 layers x 0.5 us each: a 156 us floor, gap 1000 / 156 = 6.4x.
  EXPECT_EQ(words_of_line(text, "fp8 ").at(6), "156.0");
  EXPECT_EQ(words_of_line(text, "fp8 ").at(7), "6.4x");
}

// An op of a timed strategy that was not measured (its time null in a report read back) has a dash
// for every figure its time makes, in the table as in the JSON, and is read back the same.
TEST(StepReportText, AnOpNeverMeasuredShowsADashForItsTimeAndWhatItMakes) {
  StepReport r = measured_report();
  OpResult& indexer = r.strategies[0].ops[1];
  indexer.us = indexer.p10_us = indexer.p90_us = 0;
  analyze_step(r);
  const std::string text = format_report(r);
  const std::vector<std::string> row = words_of_line(text, "  indexer_logits ");
  ASSERT_EQ(row.size(), 13u) << text;  // op, us, share, moved (2 words), GB/s, % copy, TFLOP/s, % bf16, floor, gap,
                                       // launches, kernel
  for (const std::size_t column : {1, 2, 5, 6, 7, 8, 10}) EXPECT_EQ(row[column], "-") << "column " << column;
  EXPECT_EQ(row[9], "81.9");  // the floor needs no time: 78 x 4,460,672 B at 4250 GB/s
  const nlohmann::json j = nlohmann::json::parse(report_json(r));
  const nlohmann::json& op = j["strategies"][0]["ops"][1];
  for (const char* key : {"us", "p10_us", "p90_us", "share", "gbps", "tflops", "pct_of_copy", "pct_of_matrix", "gap"}) {
    EXPECT_TRUE(op[key].is_null()) << key;
  }
  const StepReport back = parse_report_json(report_json(r));
  EXPECT_EQ(format_report(back), text);
  EXPECT_EQ(report_json(back), report_json(r));
}

TEST(StepReportJson, DerivedFieldsCarryTheirOwnValues) {
  StepReport r = measured_report();
  r.strategies[0].ops[1].p10_us = 290;
  r.strategies[0].ops[1].p90_us = 320;
  analyze_step(r);
  const nlohmann::json j = nlohmann::json::parse(report_json(r));
  const nlohmann::json& sparse = j["strategies"][0]["ops"][3];
  const double fp8_layer = 2048 * 656.0 + q_o_lse(r.shape) + 2048 * 4.0;  // the FP8-native decode's bytes a layer
  EXPECT_DOUBLE_EQ(sparse["pct_of_copy"].get<double>(), 100.0 * (78 * fp8_layer / (350 * 1e3)) / 4250);
  EXPECT_DOUBLE_EQ(sparse["pct_of_matrix"].get<double>(), 100.0 * (78 * 2.0 * 8 * (576 + 512) * 2048 / 350e6) / 766);
  // cast_full's decode moves the pool every layer; its floor's bytes are the FP8-native op's.
  const nlohmann::json& cast = j["strategies"][1]["ops"][3];
  EXPECT_DOUBLE_EQ(cast["bytes"].get<double>(),
                   78 * (495040 * (656.0 + 1152) + 2048 * 1152.0 + q_o_lse(r.shape) + 2048 * 4.0));
  EXPECT_DOUBLE_EQ(cast["floor_bytes"].get<double>(), 78 * fp8_layer);
  // An op's spread is its own, and reads back.
  EXPECT_EQ(j["strategies"][0]["ops"][1]["p10_us"], 290.0);
  EXPECT_EQ(j["strategies"][0]["ops"][1]["p90_us"], 320.0);
  const StepReport back = parse_report_json(report_json(r));
  EXPECT_EQ(back.strategies[0].ops[1].p10_us, 290);
  EXPECT_EQ(back.strategies[0].ops[1].p90_us, 320);
  // A batch of 4 at one token a 1000 us step: 4000 tokens/s.
  r.shape.batch = 4;
  analyze_step(r);
  const nlohmann::json four = nlohmann::json::parse(report_json(r))["strategies"][0];
  EXPECT_DOUBLE_EQ(four["tokens_per_s_stream"].get<double>(), 1000.0);
  EXPECT_DOUBLE_EQ(four["tokens_per_s_batch"].get<double>(), 4000.0);
}

TEST(StepReportJson, RoundTripsTheMeasuredFieldsAndDerivesTheRest) {
  StepReport r = measured_report();
  r.notes.push_back("pool grown");
  r.latentkv = "0.1.0 (CUDA backends for sm_90a)";
  r.launch_us = 0.55;
  r.strategies[0].ops[2].launches = 2;
  analyze_step(r);
  const StepReport back = parse_report_json(report_json(r));
  EXPECT_EQ(back.command, r.command);
  EXPECT_EQ(back.latentkv, r.latentkv);
  EXPECT_EQ(back.device, r.device);
  EXPECT_EQ(back.notes, r.notes);
  EXPECT_EQ(back.seed, 7u);
  EXPECT_EQ(back.shape.pool_tokens, 495040);
  EXPECT_EQ(back.shape.layers, 78);
  EXPECT_EQ(back.matrix_how, r.matrix_how);
  EXPECT_DOUBLE_EQ(back.launch_us, 0.55);
  ASSERT_EQ(back.strategies.size(), 3u);
  for (std::size_t i = 0; i < r.strategies.size(); ++i) {
    const StrategyResult &a = r.strategies[i], &b = back.strategies[i];
    EXPECT_EQ(b.name, a.name);
    EXPECT_EQ(b.status, a.status);
    EXPECT_EQ(b.timed, a.timed);
    EXPECT_DOUBLE_EQ(b.step_us, a.step_us);
    EXPECT_DOUBLE_EQ(b.gap, a.gap);
    EXPECT_DOUBLE_EQ(b.speedup_vs_cast_full, a.speedup_vs_cast_full);
    ASSERT_EQ(b.ops.size(), a.ops.size());
    for (std::size_t k = 0; k < a.ops.size(); ++k) {
      EXPECT_EQ(b.ops[k].op, a.ops[k].op);
      EXPECT_EQ(b.ops[k].kernel, a.ops[k].kernel);
      EXPECT_DOUBLE_EQ(b.ops[k].launches, a.ops[k].launches);
      EXPECT_DOUBLE_EQ(b.ops[k].floor_us, a.ops[k].floor_us);
      EXPECT_DOUBLE_EQ(b.ops[k].gap, a.ops[k].gap);
      EXPECT_DOUBLE_EQ(b.ops[k].work.bytes, a.ops[k].work.bytes);
    }
  }
  EXPECT_EQ(format_report(back), format_report(r));
}

TEST(StepReportJson, ReadsReportsWrittenBeforeLaunchesWereCounted) {
  StepReport r = measured_report();
  analyze_step(r);
  std::string text = report_json(r);
  for (const std::string key : {"\"launch_us\"", "\"launches\""}) {
    for (std::size_t at = text.find(key); at != std::string::npos; at = text.find(key)) {
      text.erase(at, text.find('\n', at) - at + 1);  // the key's whole line
    }
  }
  ASSERT_EQ(text.find("launch"), std::string::npos);
  const StepReport back = parse_report_json(text);
  EXPECT_EQ(back.launch_us, 0);
  EXPECT_EQ(back.strategies[0].ops[0].launches, 0);
  EXPECT_EQ(format_report(back), format_report(r));
}

TEST(StepReportJson, RejectsWhatIsNotAReport) {
  EXPECT_THROW(parse_report_json("{"), std::invalid_argument);
  EXPECT_THROW(parse_report_json(R"({"command": "x"})"), std::invalid_argument);
  std::string text = report_json(measured_report());
  const std::size_t at = text.find("\"sparse_decode\"");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 15, "\"warp_decode\"");
  EXPECT_THROW(parse_report_json(text), std::invalid_argument);
  nlohmann::json versioned = nlohmann::json::parse(report_json(measured_report()));
  versioned["latentkv"] = 5;
  EXPECT_THROW(parse_report_json(versioned.dump()), std::invalid_argument);
  versioned["latentkv"] = nullptr;  // a report written before the field, or by a build that left it empty
  EXPECT_EQ(parse_report_json(versioned.dump()).latentkv, "");
}

// What is wrong in a report is named by its JSON path, without nlohmann's exception tag.
TEST(StepReportJson, AWrongFieldIsNamedByItsPath) {
  const auto error_of = [](const std::string& text) {
    try {
      parse_report_json(text);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  nlohmann::json j = nlohmann::json::parse(report_json(measured_report()));
  j["shape"]["batch"] = "2";
  EXPECT_EQ(error_of(j.dump()), "shape.batch = \"2\": expected an integer in 1 .. 4096");
  j = nlohmann::json::parse(report_json(measured_report()));
  j["shape"].erase("tp");
  EXPECT_EQ(error_of(j.dump()), "/shape: key 'tp' not found");
  j = nlohmann::json::parse(report_json(measured_report()));
  j["strategies"][0]["ops"][1]["us"] = "x";
  EXPECT_EQ(error_of(j.dump()), "/strategies/0/ops/1/us: type must be number, but is string");
  EXPECT_EQ(error_of("[]"), "a JSON object at the top, not array");
}

TEST(StepReportJson, ValuesNeverMeasuredAreNullWhereTheTableHasADash) {
  StepReport r = measured_report();  // a cast_full, a strategy not timed
  r.copy_gbps = r.read_gbps = r.matrix_tflops = 0;  // as on the CPU: no ceilings, so no floors
  r.matrix_how.clear();
  r.cpu_reference = true;
  r.strategies.erase(r.strategies.begin() + 1);  // no cast_full: no speed-up
  analyze_step(r);
  const nlohmann::json j = nlohmann::json::parse(report_json(r));
  for (const char* key : {"read_gbps", "copy_gbps", "matrix_tflops", "matrix_how", "launch_us"}) {
    EXPECT_TRUE(j[key].is_null()) << key;
  }
  const nlohmann::json& fp8 = j["strategies"][0];
  EXPECT_DOUBLE_EQ(fp8["step_us"].get<double>(), 1000);
  EXPECT_DOUBLE_EQ(fp8["tokens_per_s_stream"].get<double>(), 1000);
  for (const char* key : {"floor_us", "gap", "speedup_vs_cast_full"}) EXPECT_TRUE(fp8[key].is_null()) << key;
  const nlohmann::json& append = fp8["ops"][0];
  EXPECT_TRUE(append["gbps"].is_number());
  for (const char* key : {"floor_us", "gap", "pct_of_copy", "pct_of_matrix", "tflops", "launches"}) {
    EXPECT_TRUE(append[key].is_null()) << key;
  }
  EXPECT_TRUE(fp8["ops"][1]["tflops"].is_number());  // the indexer computes: its rate is measured
  const nlohmann::json& failed = j["strategies"][1];  // not timed: no time at all
  for (const char* key : {"step_us", "step_p10_us", "step_p90_us", "ops_us", "tokens_per_s_stream"}) {
    EXPECT_TRUE(failed[key].is_null()) << key;
  }
  EXPECT_TRUE(failed["ops"][0]["us"].is_null());

  // Read back as 0, the same report; so is a report written before the nulls, with 0 in their place.
  const StepReport back = parse_report_json(report_json(r));
  EXPECT_EQ(format_report(back), format_report(r));
  EXPECT_EQ(report_json(back), report_json(r));
  nlohmann::json zeros = j;
  for (const char* key : {"read_gbps", "copy_gbps", "matrix_tflops", "launch_us"}) zeros[key] = 0.0;
  zeros["matrix_how"] = "";
  for (nlohmann::json& st : zeros["strategies"]) {
    for (auto& [key, value] : st.items()) {
      if (value.is_null()) value = 0.0;
    }
    for (nlohmann::json& op : st["ops"]) {
      for (auto& [key, value] : op.items()) {
        if (value.is_null()) value = 0.0;
      }
    }
  }
  EXPECT_EQ(format_report(parse_report_json(zeros.dump())), format_report(r));
}

TEST(StepReportJson, RejectsAnInconsistentReportNamingTheField) {
  StepReport r = measured_report();
  analyze_step(r);
  const nlohmann::json good = nlohmann::json::parse(report_json(r));
  const auto problem = [&](const std::function<void(nlohmann::json&)>& change) -> std::string {
    nlohmann::json j = good;
    change(j);
    try {
      parse_report_json(j.dump());
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "accepted";
  };
  EXPECT_EQ(problem([](nlohmann::json& j) { j["shape"]["batch"] = 0; }),
            "shape.batch = 0: expected an integer in 1 .. 4096");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["shape"]["layers"] = 0; }),
            "shape.layers = 0: expected an integer in 1 .. 2147483647");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["shape"]["model_layers"] = 3; }),
            "shape.model_layers = 3: expected an integer in 78 .. 2147483647");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["shape"]["context"] = 0; }),
            "shape.context = 0: expected an integer in 1 .. 2147483647");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["strategies"][1]["ops"][3]["us"] = -2.5; }),
            "strategies[1].ops[3].us = -2.5: expected >= 0 (or null: not measured)");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["strategies"][0]["step_p90_us"] = -1.0; }),
            "strategies[0].step_p90_us = -1.0: expected >= 0 (or null: not measured)");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["copy_gbps"] = -1.0; }),
            "copy_gbps = -1.0: expected >= 0 (or null: not measured)");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["strategies"] = nlohmann::json::array(); }),
            "strategies = []: expected a list of one or more strategies");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["strategies"][0]["path"] = "dense"; }),
            "strategies[0].ops = append, indexer_logits, topk, sparse_decode: expected append, dense_decode (the "
            "dense path)");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["iters"] = 0; }), "iters = 0: expected an integer in 1 .. 2147483647");
  // Integers past their field's type, or fractions, are refused, not wrapped or truncated.
  EXPECT_EQ(problem([](nlohmann::json& j) { j["shape"]["batch"] = 4294967297u; }),
            "shape.batch = 4294967297: expected an integer in 1 .. 4096");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["shape"]["batch"] = 2147483648u; }),
            "shape.batch = 2147483648: expected an integer in 1 .. 4096");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["shape"]["pool_tokens"] = 18446744073709551615u; }),
            "shape.pool_tokens = 18446744073709551615: expected an integer in 1 .. 2147483647");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["warmup"] = 4294967296u; }),
            "warmup = 4294967296: expected an integer in 0 .. 2147483647");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["iters"] = 2.7; }),
            "iters = 2.7: expected an integer in 1 .. 2147483647");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["warmup"] = -1; }),
            "warmup = -1: expected an integer in 0 .. 2147483647");
  EXPECT_EQ(problem([](nlohmann::json& j) {
              j["shape"]["q_len"] = 2;
              j["shape"]["context"] = 1;
            }),
            "shape.context = 1: expected an integer in 2 .. 2147483647");  // L counts the new tokens
  // A shape no run could have, held to the bounds of step's options and of the ops (a q_len of 2^31
  // would have the work model loop that often).
  EXPECT_EQ(problem([](nlohmann::json& j) { j["shape"]["q_len"] = 2147483647; }),
            "shape.q_len = 2147483647: expected an integer in 1 .. 4");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["shape"]["heads"] = 129; }),
            "shape.heads = 129: expected an integer in 1 .. 128");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["shape"]["indexer_heads"] = 65; }),
            "shape.indexer_heads = 65: expected an integer in 1 .. 64");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["shape"]["topk"] = 2049; }),
            "shape.topk = 2049: expected an integer in 1 .. 2048");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["shape"]["page_size"] = 2147483647; }),
            "shape.page_size = 2147483647: expected an integer in 1 .. 1073741824");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["shape"]["context"] = 9223372036854775807; }),
            "shape.context = 9223372036854775807: expected an integer in 1 .. 2147483647");
  // Text printed as it is carries no control characters (a crafted report's escape sequences would
  // reach the terminal); the model is a preset; a timed step lies within its own spread.
  EXPECT_EQ(problem([](nlohmann::json& j) { j["command"] = "latentkv step \x1b[31mRED\r"; }),
            "command = \"latentkv step \\u001b[31mRED\\r\": expected text without control characters");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["notes"][0] = "a\nb"; }),
            "notes[0] = \"a\\nb\": expected text without control characters");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["strategies"][1]["ops"][0]["kernel"] = "k\x07"; }),
            "strategies[1].ops[0].kernel = \"k\\u0007\": expected text without control characters");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["command"] = "a\u009b31mRED"; }),
            "command = \"a\\u009b31mRED\": expected text without control characters");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["notes"][0] = "next\u0085line"; }),
            "notes[0] = \"next\\u0085line\": expected text without control characters");
  EXPECT_EQ(problem([](nlohmann::json& j) { j["notes"][0] = "caf\u00e9 \u00a0"; }), "accepted");  // not controls
  EXPECT_THAT(problem([](nlohmann::json& j) { j["shape"]["model"] = "bogus"; }),
              ::testing::StartsWith("shape.model = \"bogus\": expected "));
  EXPECT_THAT(problem([](nlohmann::json& j) { j["strategies"][0]["step_us"] = 0.0; }),
              ::testing::StartsWith("strategies[0].step_us = 0.0: expected a timed step within its p10 .. p90 ("));
  EXPECT_THAT(problem([](nlohmann::json& j) { j["strategies"][0]["step_p10_us"] = 1e9; }),
              ::testing::StartsWith("strategies[0].step_us = "));
  EXPECT_EQ(problem([](nlohmann::json&) {}), "accepted");
}

// ---- the top-k check ------------------------------------------------------------------------------

// One request of 10 tokens over pages of 4: positions 0-3 on page 2, 4-7 on page 0, 8-9 on page 3.
struct TopkCase {
  StepShape shape;
  StepTables tables;
  std::vector<float> logits;  // [1, q_len, 12]
  TopkCase() {
    shape.page_size = 4;
    shape.context = 10;
    shape.q_len = 1;
    shape.topk = 3;
    shape.batch = 1;
    tables.num_pages = 4;
    tables.max_pages = 3;
    tables.block_table = {2, 0, 3};
    tables.seq_lens = {10};
    logits = {0.1f, 0.9f, 0.3f, 0.9f, 0.2f, 0.0f, 0.5f, 0.4f, 0.6f, 0.7f, -INFINITY, -INFINITY};
  }
  std::int32_t slot(int position) const { return tables.block_table[position / 4] * 4 + position % 4; }
  std::string check(const std::vector<std::int32_t>& slots) const {
    return topk_problem(logits, slots, shape, tables, 1, 12);
  }
};

TEST(StepTopkCheck, AcceptsAnyOrderAndTieBreak) {
  const TopkCase c;
  // The top 3 are positions 1 and 3 (0.9 each) and 9 (0.7), in any order.
  EXPECT_EQ(c.check({c.slot(9), c.slot(3), c.slot(1)}), "");
  EXPECT_EQ(c.check({c.slot(1), c.slot(9), c.slot(3)}), "");
  TopkCase tie = c;
  tie.logits[9] = 0.6f;  // now 8 and 9 tie for the third place: either is a top-3
  EXPECT_EQ(tie.check({tie.slot(1), tie.slot(3), tie.slot(8)}), "");
  EXPECT_EQ(tie.check({tie.slot(1), tie.slot(3), tie.slot(9)}), "");
}

TEST(StepTopkCheck, RejectsWrongAnswers) {
  const TopkCase c;
  EXPECT_NE(c.check({c.slot(1), c.slot(3), c.slot(8)}).find("left out"), std::string::npos);  // 0.6 < 0.7
  EXPECT_NE(c.check({c.slot(1), c.slot(1), c.slot(9)}).find("twice"), std::string::npos);
  EXPECT_NE(c.check({c.slot(1), c.slot(3), -1}).find("expected min(k, visible)"), std::string::npos);
  EXPECT_NE(c.check({c.slot(1), c.slot(3), 4 * 1 + 0}).find("not a slot"),
            std::string::npos);  // page 1 is not the request's
  EXPECT_NE(c.check({c.slot(1), c.slot(3), static_cast<std::int32_t>(0xA5A5A5A5)}).find("not a slot"),
            std::string::npos);
}

TEST(StepTopkCheck, RowsSeeingFewerThanKTakeThemAllAndPad) {
  TopkCase c;
  c.shape.topk = 12;
  std::vector<std::int32_t> all;
  for (int p = 9; p >= 0; --p) all.push_back(c.slot(p));
  all.push_back(-1);
  all.push_back(-1);
  EXPECT_EQ(c.check(all), "");
  // With q_len 2 the first new token does not see position 9.
  c.shape.q_len = 2;
  c.logits.insert(c.logits.end(), c.logits.begin(), c.logits.end());  // [1, 2, 12]: both rows alike
  std::vector<std::int32_t> two(all.begin() + 1, all.end());
  two.push_back(-1);
  two.insert(two.end(), all.begin(), all.end());
  EXPECT_EQ(topk_problem(c.logits, two, c.shape, c.tables, 1, 12), "");
  std::vector<std::int32_t> wrong(all);
  wrong.insert(wrong.end(), all.begin(), all.end());
  EXPECT_NE(topk_problem(c.logits, wrong, c.shape, c.tables, 1, 12).find("not a slot the row sees"), std::string::npos);
}

TEST(StepTopkCheck, EachRequestIsCheckedWithItsOwnPagesAndRows) {
  // Two requests of 10 tokens over pages of 4, two new tokens each (rows see 9 and 10): request 0 on
  // pages 2, 0, 3 with the logits above; request 1 on pages 1, 5, 4, its largest logits at 0, 8, 7.
  TopkCase c;
  c.shape.batch = 2;
  c.shape.q_len = 2;
  c.tables.num_pages = 6;
  c.tables.block_table = {2, 0, 3, 1, 5, 4};
  c.tables.seq_lens = {10, 10};
  const std::vector<float> first = c.logits;
  const std::vector<float> second = {0.9f, 0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f, 0.7f, 0.8f, 0.0f, -INFINITY, -INFINITY};
  std::vector<float> logits;  // [2, 2, 12]
  for (const std::vector<float>* row : {&first, &first, &second, &second}) {
    logits.insert(logits.end(), row->begin(), row->end());
  }
  const auto slot = [&](int b, int position) { return c.tables.block_table[b * 3 + position / 4] * 4 + position % 4; };
  std::vector<std::int32_t> slots = {slot(0, 1), slot(0, 3), slot(0, 8),   // row 0 sees 0..8: 0.6 third
                                     slot(0, 1), slot(0, 3), slot(0, 9),   // row 1 sees 0..9: 0.7 third
                                     slot(1, 0), slot(1, 8), slot(1, 7),   // request 1's rows
                                     slot(1, 0), slot(1, 8), slot(1, 7)};
  EXPECT_EQ(topk_problem(logits, slots, c.shape, c.tables, 2, 12), "");
  // Request 1 answered with request 0's slots: not its pages.
  std::copy(slots.begin(), slots.begin() + 6, slots.begin() + 6);
  EXPECT_NE(topk_problem(logits, slots, c.shape, c.tables, 2, 12).find("top-k row [1, 0]: "), std::string::npos);
}

TEST(StepTopkCheck, ReferenceLogitsAllowANearTieOfTwiceTheIndexerBound) {
  // Largest |logit| 10: a near tie may go either way by 2 x (1e-4 + 1e-5 x 10) = 4e-4.
  const std::vector<std::int32_t> table = {0};  // page 0: slot = position
  const std::vector<std::int32_t> chosen = {0, 2};
  // 5.0 left out for 4.9997, 3e-4 below it: within; for 4.9995, 5e-4 below: beyond.
  EXPECT_EQ(topk_row_problem_near({10.0f, 5.0f, 4.9997f, 1.0f}, table.data(), 4, chosen.data(), 2), "");
  EXPECT_NE(topk_row_problem_near({10.0f, 5.0f, 4.9995f, 1.0f}, table.data(), 4, chosen.data(), 2).find("left out"),
            std::string::npos);
}

TEST(StepTopkCheck, AnOutputPassesWithinEitherToleranceOfSpecSection5) {
  // |a - b| <= atol or <= rtol |b|: 0.01 off 1.0 is within 2/128 relative though beyond 1e-3 absolute.
  const std::vector<double> got = {1.01, -2.0}, want = {1.0, -2.0};
  const auto a = [&](std::size_t i) { return got[i]; };
  const auto b = [&](std::size_t i) { return want[i]; };
  EXPECT_TRUE(check_close(2, a, b, 1e-3, 2.0 / 128.0, -1.0).ok);
  EXPECT_FALSE(check_close(2, a, b, 1e-3, 0.005, -1.0).ok);  // beyond both
}

}  // namespace
}  // namespace latentkv::tools
