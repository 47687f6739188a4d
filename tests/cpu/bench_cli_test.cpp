// `latentkv bench`'s command line and what it prints, without a GPU (tools/bench_cli.hpp): the repro
// line parses back to the options it was made from, the table shows figures only for timed rows and
// "-" for what was not measured, and the JSON carries the same with nulls. Also the count of cache
// entries a sparse row credits its op with (tools/bench_work.hpp), and the median and spread every
// timing reports (tools/spread.hpp).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <limits>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_cli.hpp"
#include "bench_work.hpp"
#include "latentkv/error.hpp"
#include "latentkv/version.hpp"
#include "spread.hpp"
#include "support/text_lines.hpp"

namespace {

using latentkv::tools::BenchOptions;
using latentkv::tools::BenchReport;
using latentkv::tools::BenchRow;
using ::testing::HasSubstr;
using ::testing::Not;
using latentkv::testing::line_of;
using latentkv::testing::words_of;

// The options `latentkv bench <args>` parses into, and those typed; parse errors propagate as
// CLI11's exceptions.
struct Parsed {
  BenchOptions options;
  std::set<std::string> given;
};
Parsed parse_bench_given(const std::string& args) {
  CLI::App app{"bench"};
  Parsed parsed;
  latentkv::tools::add_bench_options(app, parsed.options);
  app.parse(args, false);
  parsed.given = latentkv::tools::given_options(app);
  return parsed;
}
BenchOptions parse_bench(const std::string& args) { return parse_bench_given(args).options; }

// Options for `op` with every field that op reads set away from its default.
BenchOptions options_for(const std::string& op) {
  BenchOptions o;
  o.op = op;
  o.model = "deepseek-v3.2";
  o.tp = 4;
  o.batch = 3;
  o.context = 9000;
  o.pool = 123457;
  o.page_size = 32;
  o.backends = {"cuda", "cast_full"};
  o.warmup = 2;
  o.iters = 7;
  o.launch = "paced";
  o.check_requests = 1;
  o.seed = std::numeric_limits<std::uint64_t>::max();
  if (op.ends_with("prefill")) o.new_tokens = 300;
  else o.q_len = 3;
  if (op != "mla_decode" && op != "indexer_logits" && op != "mla_prefill") o.topk = 512;
  return o;
}

const std::vector<std::string> kOps = {"mla_decode",  "sparse_mla_decode",  "indexer_logits",
                                       "topk",        "dsa_decode",         "mla_prefill",
                                       "sparse_mla_prefill", "indexer_prefill", "dsa_prefill"};

TEST(BenchCli, ReproLineParsesBackToTheOptionsItWasMadeFrom) {
  std::vector<BenchOptions> cases;
  for (const std::string& op : kOps) cases.push_back(options_for(op));
  BenchOptions heads = options_for("mla_decode");
  heads.heads = 16;
  heads.splits = 12;
  heads.context_min = 1000;
  heads.kv_dtype = "bf16";
  cases.push_back(heads);
  BenchOptions sparse_splits = options_for("sparse_mla_decode");
  sparse_splits.splits = 5;
  cases.push_back(sparse_splits);
  cases.push_back(BenchOptions{});  // the defaults
  BenchOptions with_json = options_for("topk");
  with_json.json = "/tmp/bench.json";
  cases.push_back(with_json);

  for (const BenchOptions& o : cases) {
    const std::string line = latentkv::tools::repro_line(o);
    const std::string prefix = "latentkv bench ";
    ASSERT_EQ(line.rfind(prefix, 0), 0u) << line;
    Parsed parsed;
    ASSERT_NO_THROW(parsed = parse_bench_given(line.substr(prefix.size()))) << line;
    BenchOptions want = o;
    want.json.clear();  // where a run writes its JSON is not part of the measurement
    EXPECT_EQ(parsed.options, want) << line;
    EXPECT_EQ(parsed.given.contains("--check-requests"), line.find(" --check-requests ") != std::string::npos);
    EXPECT_NO_THROW(latentkv::tools::check_bench_options(parsed.options, parsed.given)) << line;
  }
}

TEST(BenchCli, ReproLineNamesOnlyTheOptionsTheOpReads) {
  const auto has = [](const std::string& line, const std::string& flag) {
    return (line + " ").find(" " + flag + " ") != std::string::npos;
  };
  for (const std::string& op : kOps) {
    const std::string line = latentkv::tools::repro_line(options_for(op));
    const bool prefill = op.ends_with("prefill");
    const bool ranks = op != "mla_decode" && op != "indexer_logits" && op != "mla_prefill";
    EXPECT_EQ(has(line, "--new-tokens"), prefill) << line;
    EXPECT_EQ(has(line, "--q-len"), !prefill) << line;
    EXPECT_EQ(has(line, "--topk"), ranks) << line;
    const bool bf16_cache = op == "mla_decode" || op == "sparse_mla_decode" || op == "mla_prefill" ||
                            op == "sparse_mla_prefill" || op == "dsa_prefill";
    EXPECT_EQ(has(line, "--kv-dtype"), bf16_cache) << line;
    EXPECT_FALSE(has(line, "--heads") || has(line, "--splits") || has(line, "--context-min") || has(line, "--json"))
        << line;
  }
  const std::string defaults = latentkv::tools::repro_line(BenchOptions{});
  EXPECT_FALSE(has(defaults, "--check-requests")) << defaults;
  EXPECT_THAT(defaults, HasSubstr(" --backends cuda,gather_cast,cast_full "));
}

// A run of three backends: one timed and passed, one timed without a cast_full beside it to compare
// with, one whose output failed its check (never timed).
BenchReport sample_report(double flops) {
  BenchReport r;
  r.device = "NVIDIA H200, sm_90, 132 multiprocessors";
  r.read_gbps = 4540;
  r.copy_gbps = 4300;
  r.gather_gbps = 4050;
  r.empty_launch_us = 3.6;
  r.empty_graph_us = 2.8;
  r.rotation_sets = 3;
  r.rotation_cold = false;
  BenchRow cuda{.backend = "cuda", .kernel = "mla_decode_narrow", .status = "pass", .num_splits = 4};
  cuda.bytes = 430e6;
  cuda.flops = flops;
  latentkv::tools::set_timing(cuda, 100.0, 99.0, 101.5, r.read_gbps, r.copy_gbps);
  cuda.speedup = 14.7;
  cuda.host_us = 6.25;
  BenchRow gather{.backend = "gather_cast", .kernel = "gather+cast", .status = "pass", .num_splits = 1};
  gather.bytes = 430e6;
  gather.flops = flops;
  latentkv::tools::set_timing(gather, 540.0, 530.0, 550.0, r.read_gbps, r.copy_gbps);
  BenchRow failed{.backend = "cast_full", .kernel = "cast", .status = "FAIL: o[0,0,3] = 1.5, want 1.25"};
  failed.bytes = 430e6;
  r.rows = {cuda, gather, failed};
  return r;
}

TEST(BenchCli, TableShowsFiguresOnlyWhereTheyWereMeasured) {
  const BenchOptions o = options_for("mla_decode");
  BenchReport r = sample_report(2.0e9);
  r.matrix_tflops = 800;
  r.matrix_how = "cuBLAS bf16";
  const std::string table = latentkv::tools::format_report(o, r);

  const std::string cuda = line_of(table, "cuda ");
  EXPECT_THAT(cuda, HasSubstr(" 100.0 "));
  EXPECT_THAT(cuda, HasSubstr(" 99.0..101.5 "));
  EXPECT_THAT(cuda, HasSubstr(" 4300 "));   // 430 MB in 100 us
  EXPECT_THAT(cuda, HasSubstr(" 100.0% "));  // of the device copy
  EXPECT_THAT(cuda, HasSubstr(" 20.0 "));   // TFLOP/s
  EXPECT_THAT(cuda, HasSubstr(" 14.7x "));
  EXPECT_THAT(cuda, HasSubstr("pass; mla_decode_narrow, 4 splits; host 6.2 us a call"));
  const std::string gather = line_of(table, "gather_cast ");
  EXPECT_THAT(gather, HasSubstr(" -  pass; gather+cast"));  // no cast_full timed to compare with
  const std::string failed = line_of(table, "cast_full ");
  EXPECT_THAT(failed, HasSubstr("FAIL: o[0,0,3] = 1.5, want 1.25"));
  EXPECT_THAT(failed, Not(HasSubstr("4300")));
  EXPECT_THAT(failed, Not(HasSubstr("%")));

  EXPECT_THAT(table, HasSubstr("device copy 4300 GB/s"));
  EXPECT_THAT(table, HasSubstr("warning: the pool holds 3 rotation sets"));
  EXPECT_THAT(table, HasSubstr("cuda: 20.0 TFLOP/s is 2.5% of the matrix rate above"));
  EXPECT_THAT(table, Not(HasSubstr("cast_full: ")));
  EXPECT_THAT(table, HasSubstr("(the calls below are paced by the host)"));
  EXPECT_THAT(table, HasSubstr("shape: mla_decode, deepseek-v3.2 tp 4, batch 3, context 9000, q_len 3, page 32"));
  EXPECT_THAT(table, HasSubstr("\nrepro: " + latentkv::tools::repro_line(o) + "\n"));

  // An op with no FLOPs counted (the top-k) shows none, and says nothing of the matrix rate.
  const std::string topk = latentkv::tools::format_report(options_for("topk"), sample_report(0));
  EXPECT_THAT(line_of(topk, "cuda "), HasSubstr("       -     14.7x  pass"));
  EXPECT_THAT(topk, Not(HasSubstr("of the matrix rate")));
  EXPECT_THAT(topk, HasSubstr(", topk 512, "));

  // The prefills are timed on one set of requests: no advice to enlarge the pool.
  const std::string prefill = latentkv::tools::format_report(options_for("mla_prefill"), sample_report(2.0e9));
  EXPECT_THAT(prefill, HasSubstr("note: every call reads the same requests"));
  EXPECT_THAT(prefill, Not(HasSubstr("--pool gives more")));
  EXPECT_THAT(prefill, HasSubstr(", new tokens 300, page 32"));
  BenchReport cold = sample_report(2.0e9);
  cold.rotation_cold = true;
  EXPECT_THAT(latentkv::tools::format_report(options_for("mla_prefill"), cold), Not(HasSubstr("note: every call")));
  EXPECT_THAT(latentkv::tools::format_report(o, cold), Not(HasSubstr("warning: ")));

  // Sparse decodes rotate index rows over fewer sets of requests: the warning counts both.
  BenchReport shared = sample_report(2.0e9);
  shared.rotation_sets = 75;
  shared.request_sets = 1;
  EXPECT_THAT(latentkv::tools::format_report(options_for("sparse_mla_decode"), shared),
              HasSubstr("warning: the pool holds 1 set(s) of requests for the 75 rotation sets of index rows"));
  EXPECT_EQ(nlohmann::json::parse(latentkv::tools::report_json(o, shared)).at("request_sets"), 1);
}

TEST(BenchCli, TableColumnsAndTheLeastCallAreTheirOwn) {
  const BenchOptions o = options_for("mla_decode");
  BenchReport r = sample_report(2.0e9);
  // 430 MB in 100 us: 4300 GB/s, 100.0% of the 4300 GB/s copy, 4300 / 4540 = 94.7% of the read-only stream.
  const std::vector<std::string> cuda = words_of(line_of(latentkv::tools::format_report(o, r), "cuda "));
  ASSERT_GE(cuda.size(), 8u);
  EXPECT_EQ(std::vector<std::string>(cuda.begin(), cuda.begin() + 8),
            (std::vector<std::string>{"cuda", "100.0", "99.0..101.5", "4300", "100.0%", "94.7%", "20.0", "14.7x"}));
  // The least call is timed as the calls are: one launch, or a one-kernel graph when they are graphs.
  EXPECT_THAT(latentkv::tools::format_report(o, r),
              HasSubstr("least call (this run): 3.6 us, an empty one-CTA kernel as one launch"));
  r.timing = "CUDA graph replays";
  EXPECT_THAT(latentkv::tools::format_report(o, r),
              HasSubstr("least call (this run): 2.8 us, an empty one-CTA kernel as a one-kernel graph"));
}

TEST(BenchCli, JsonFieldsCarryTheirOwnValues) {
  const BenchOptions o = options_for("mla_decode");
  const nlohmann::json j = nlohmann::json::parse(latentkv::tools::report_json(o, sample_report(2.0e9)));
  EXPECT_EQ(j.at("empty_launch_us"), 3.6);
  EXPECT_EQ(j.at("empty_graph_us"), 2.8);
  EXPECT_EQ(j.at("request_sets"), 3);  // one set of requests per rotation set
  const nlohmann::json& cuda = j.at("rows")[0];
  EXPECT_EQ(cuda.at("p10_us"), 99.0);
  EXPECT_EQ(cuda.at("p90_us"), 101.5);
  EXPECT_EQ(cuda.at("host_us"), 6.25);
  EXPECT_DOUBLE_EQ(cuda.at("gbps").get<double>(), 430e6 / 100e-6 / 1e9);
  EXPECT_DOUBLE_EQ(cuda.at("pct_of_read").get<double>(), 100.0 * 4300 / 4540);
}

TEST(BenchCli, BoundsIncludeTheirLimit) {
  // --check-requests up to the batch, --context down to --q-len, --new-tokens up to --context.
  BenchOptions o = options_for("mla_decode");  // batch 3, q_len 3
  o.check_requests = 3;
  EXPECT_NO_THROW(latentkv::tools::check_bench_options(o, {"--check-requests"}));
  o.check_requests = 4;
  EXPECT_THROW(latentkv::tools::check_bench_options(o, {"--check-requests"}), latentkv::Error);
  o = options_for("mla_decode");
  o.context = 3;
  EXPECT_NO_THROW(latentkv::tools::check_bench_options(o, {}));
  o.context = 2;
  EXPECT_THROW(latentkv::tools::check_bench_options(o, {}), latentkv::Error);
  o = options_for("mla_prefill");  // new tokens 300
  o.context = 300;
  EXPECT_NO_THROW(latentkv::tools::check_bench_options(o, {}));
  o.context = 299;
  EXPECT_THROW(latentkv::tools::check_bench_options(o, {}), latentkv::Error);
}

// An option the op does not read is refused (not ignored while the header and the JSON print it),
// naming the option, its value, the ops that do read it and --op; the same option is taken by those
// ops.
TEST(BenchCli, OptionsTheOpDoesNotReadAreRefused) {
  struct Unread {
    std::string given;
    void (*set)(BenchOptions&);
    std::set<std::string> readers;
  };
  const std::set<std::string> decode = {"mla_decode", "sparse_mla_decode", "indexer_logits", "topk", "dsa_decode"};
  const std::set<std::string> prefill = {"mla_prefill", "sparse_mla_prefill", "indexer_prefill", "dsa_prefill"};
  const std::vector<Unread> options = {
      {"--kv-dtype bf16", [](BenchOptions& o) { o.kv_dtype = "bf16"; },
       {"mla_decode", "sparse_mla_decode", "mla_prefill", "sparse_mla_prefill", "dsa_prefill"}},
      {"--topk 1024", [](BenchOptions& o) { o.topk = 1024; },
       {"sparse_mla_decode", "topk", "dsa_decode", "sparse_mla_prefill", "indexer_prefill", "dsa_prefill"}},
      {"--q-len 2", [](BenchOptions& o) { o.q_len = 2; }, decode},
      {"--new-tokens 512", [](BenchOptions& o) { o.new_tokens = 512; }, prefill},
      {"--heads 16", [](BenchOptions& o) { o.heads = 16; },
       {"mla_decode", "sparse_mla_decode", "indexer_logits", "dsa_decode", "mla_prefill", "sparse_mla_prefill",
        "indexer_prefill", "dsa_prefill"}},
      {"--splits 4", [](BenchOptions& o) { o.splits = 4; }, {"mla_decode", "sparse_mla_decode"}},
      {"--context-min 1000", [](BenchOptions& o) { o.context_min = 1000; }, {"mla_decode"}},
  };
  for (const Unread& u : options) {
    for (const std::string& op : kOps) {
      BenchOptions o;
      o.op = op;
      u.set(o);
      if (u.readers.contains(op)) {
        EXPECT_NO_THROW(latentkv::tools::check_bench_options(o, {})) << op << " " << u.given;
        continue;
      }
      try {
        latentkv::tools::check_bench_options(o, {});
        ADD_FAILURE() << op << " took " << u.given;
      } catch (const latentkv::Error& e) {
        EXPECT_EQ(e.argument() + " " + e.value(), u.given) << e.what();
        EXPECT_THAT(e.expected(), HasSubstr("only with --op ")) << e.what();
        EXPECT_THAT(e.expected(), HasSubstr("(" + op + " does not read it)")) << e.what();
        for (const std::string& reader : u.readers) EXPECT_THAT(e.expected(), HasSubstr(reader)) << e.what();
      }
    }
  }
}

// Typed at its default value, an option the op does not read is refused all the same (the bench
// cannot tell the typed value from the default by the value alone), and typed where it is read it
// is taken.
TEST(BenchCli, OptionsTheOpDoesNotReadAreRefusedAtTheirDefaults) {
  for (const std::string& line : {"--op mla_decode --new-tokens 4096", "--op mla_decode --topk 2048",
                                  "--op mla_prefill --q-len 1", "--op topk --kv-dtype fp8"}) {
    const Parsed parsed = parse_bench_given(line);
    EXPECT_THROW(latentkv::tools::check_bench_options(parsed.options, parsed.given), latentkv::Error) << line;
    EXPECT_NO_THROW(latentkv::tools::check_bench_options(parsed.options, {})) << line << " (untyped)";
  }
  for (const std::string& line : {"--op mla_prefill --new-tokens 4096", "--op topk --topk 2048",
                                  "--op mla_decode --q-len 1 --kv-dtype fp8_e4m3"}) {
    const Parsed parsed = parse_bench_given(line);
    EXPECT_NO_THROW(latentkv::tools::check_bench_options(parsed.options, parsed.given)) << line;
  }
}

// Every bench command line of scripts/gpu_run.sh passes the checks a GPU run makes first: each
// `run_bench <name> <args>` row, and the profile step's default shapes for every --op (PROFILE_OP
// may name any). A row refused there would cost a GPU session its figure.
TEST(BenchCli, TheGpuScriptsCommandLinesPassTheirChecks) {
  std::ifstream script(std::string(LKV_SOURCE_DIR) + "/scripts/gpu_run.sh");
  ASSERT_TRUE(script) << "scripts/gpu_run.sh";
  std::vector<std::string> lines;
  int profile_shapes = 0;
  for (std::string line; std::getline(script, line);) {
    const std::string text = line.substr(std::min(line.find_first_not_of(' '), line.size()));
    if (text.starts_with("run_bench ")) {
      std::istringstream words(text);
      std::string command, name, rest;
      words >> command >> name;
      std::getline(words, rest);
      lines.push_back(rest);
    }
    // The profile defaults: quoted "--op $op ..." shapes.
    for (std::size_t at = text.find("\"--op $op "); at != std::string::npos; at = text.find("\"--op $op ", at + 1)) {
      const std::size_t end = text.find('"', at + 1);
      ASSERT_NE(end, std::string::npos) << text;
      const std::string shape = text.substr(at + 1, end - at - 1);
      ++profile_shapes;
      for (const std::string& op : kOps) lines.push_back("--op " + op + shape.substr(std::string("--op $op").size()));
    }
  }
  EXPECT_GE(lines.size(), 20u) << "the script's rows were not found";
  EXPECT_EQ(profile_shapes, 2);
  for (const std::string& line : lines) {
    Parsed parsed;
    ASSERT_NO_THROW(parsed = parse_bench_given(line)) << line;
    EXPECT_NO_THROW(latentkv::tools::check_bench_options(parsed.options, parsed.given)) << line;
  }
}

// --heads counts indexer heads (1 .. 64) for the indexer ops and query heads (1 .. 128) for the
// others: 65 is refused for the first before anything runs, naming --heads and the op.
TEST(BenchCli, IndexerOpsTakeAtMost64Heads) {
  for (const std::string& op : kOps) {
    if (op == "topk") continue;  // reads no heads
    BenchOptions o;
    o.op = op;
    o.heads = 64;
    EXPECT_NO_THROW(latentkv::tools::check_bench_options(o, {})) << op;
    o.heads = 65;
    if (op != "indexer_logits" && op != "indexer_prefill") {
      EXPECT_NO_THROW(latentkv::tools::check_bench_options(o, {})) << op;
      continue;
    }
    try {
      latentkv::tools::check_bench_options(o, {});
      ADD_FAILURE() << op << " took --heads 65";
    } catch (const latentkv::Error& e) {
      EXPECT_EQ(e.argument(), "--heads") << e.what();
      EXPECT_EQ(e.value(), "65");
      EXPECT_THAT(e.expected(), HasSubstr("1 .. 64 for " + op)) << e.what();
    }
  }
}

// A page of more than 2^30 tokens is refused by the parser: no block-table row could hold one.
TEST(BenchCli, PageSizeAtMost2To30) {
  EXPECT_EQ(parse_bench("--page-size 1073741824").page_size, 1 << 30);
  try {
    parse_bench("--page-size 1073741825");
    ADD_FAILURE() << "--page-size 1073741825 was taken";
  } catch (const CLI::ParseError& e) {
    EXPECT_THAT(e.what(), HasSubstr("1073741825"));
    EXPECT_THAT(e.what(), HasSubstr("2^30"));
  }
}

// The pool must hold one set of the requests, in whole pages, and stay within int32 slots (as in
// `latentkv step`); refused before anything runs, not when the GPU's pages run out.
TEST(BenchCli, PoolMustHoldOneSetOfRequests) {
  for (const std::string& op : kOps) {
    BenchOptions o;
    o.op = op;
    o.batch = 3;
    o.context = 1000;
    o.page_size = 64;
    if (op.ends_with("prefill")) o.new_tokens = 100;
    o.pool = 3 * 16 * 64;  // 16 pages of 64 a request
    EXPECT_NO_THROW(latentkv::tools::check_bench_options(o, {})) << op;
    o.pool -= 1;
    try {
      latentkv::tools::check_bench_options(o, {});
      ADD_FAILURE() << op << " took a pool of " << o.pool;
    } catch (const latentkv::Error& e) {
      EXPECT_EQ(e.argument(), "--pool") << e.what();
      EXPECT_THAT(e.expected(), HasSubstr(">= 3072 tokens (3 requests of 1000 tokens take 16 pages of 64 each)"));
    }
  }
  BenchOptions big;
  big.page_size = 100;
  big.pool = 2147483647;  // rounded up to whole pages of 100: past int32 slots
  EXPECT_THROW(latentkv::tools::check_bench_options(big, {}), latentkv::Error);
  big.pool = 2147483600;
  EXPECT_NO_THROW(latentkv::tools::check_bench_options(big, {}));
  big.batch = 4096;  // 4096 x 524,288 slots
  big.context = 524288;
  EXPECT_THROW(latentkv::tools::check_bench_options(big, {}), latentkv::Error);
}

TEST(BenchCli, JsonHasTimingForTimedRowsOnlyAndNullWhereNothingWasMeasured) {
  const BenchOptions o = options_for("topk");
  const nlohmann::json j = nlohmann::json::parse(latentkv::tools::report_json(o, sample_report(0)));
  EXPECT_EQ(j.at("latentkv"), latentkv::library_description());
  EXPECT_EQ(j.at("command"), latentkv::tools::repro_line(o));
  EXPECT_EQ(j.at("copy_gbps"), 4300);
  EXPECT_EQ(j.at("rotation_cold"), false);
  EXPECT_EQ(j.at("shape").at("topk"), 512);
  EXPECT_FALSE(j.contains("matrix_tflops"));
  const nlohmann::json& rows = j.at("rows");
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].at("median_us"), 100.0);
  EXPECT_DOUBLE_EQ(rows[0].at("pct_of_copy").get<double>(), 100.0);
  EXPECT_EQ(rows[0].at("speedup_vs_cast_full"), 14.7);
  EXPECT_TRUE(rows[0].at("tflops").is_null());  // no FLOPs counted
  EXPECT_TRUE(rows[1].at("speedup_vs_cast_full").is_null());
  EXPECT_EQ(rows[2].at("timed"), false);
  EXPECT_EQ(rows[2].at("status"), "FAIL: o[0,0,3] = 1.5, want 1.25");
  for (const char* key : {"median_us", "gbps", "pct_of_copy", "tflops", "speedup_vs_cast_full", "host_us"}) {
    EXPECT_FALSE(rows[2].contains(key)) << key;
  }
  const nlohmann::json flops = nlohmann::json::parse(latentkv::tools::report_json(o, sample_report(2.0e9)));
  EXPECT_DOUBLE_EQ(flops.at("rows")[0].at("tflops").get<double>(), 20.0);
}

TEST(Spread, MedianOfAnEvenCountIsTheMeanOfTheMiddleTwo) {
  using latentkv::tools::spread_of;
  EXPECT_EQ(spread_of({}).median, 0);
  EXPECT_EQ(spread_of({7}).median, 7);
  EXPECT_EQ(spread_of({4, 2}).median, 3);
  EXPECT_EQ(spread_of({5, 1, 3}).median, 3);
  std::vector<double> twenty(20);
  for (int i = 0; i < 20; ++i) twenty[static_cast<std::size_t>(i)] = 20 - i;  // 20 .. 1
  const latentkv::tools::Spread s = spread_of(twenty);
  EXPECT_EQ(s.median, 10.5);
  EXPECT_EQ(s.p10, 3);   // the nearest rank: sample 0.1 x 19 = 1.9 -> 2 of 0 .. 19
  EXPECT_EQ(s.p90, 18);  // 17.1 -> 17
  EXPECT_EQ(s.min, 1);
}

TEST(BenchWork, SelectedEntriesCountOncePerRequestWithoutPadding) {
  // Two requests of two rows of top-k 4: request 0's rows share slots 7 and 9; request 1 selects
  // slot 7 too (another request's entry: counted again) and pads with -1.
  const std::vector<std::int32_t> rows = {7, 9, 3, -1, /**/ 9, 7, 12, 5, /**/ 7, -1, -1, -1, /**/ 8, 7, -1, -1};
  EXPECT_EQ(latentkv::tools::distinct_selected_entries(rows, 2, 4, 13), 5 + 2);
  EXPECT_EQ(latentkv::tools::distinct_selected_entries(rows, 1, 4, 13), 3 + 4 + 1 + 2);  // one row per request
  EXPECT_EQ(latentkv::tools::distinct_selected_entries(rows, 4, 4, 13), 6);  // 7, 9, 3, 12, 5, 8
  EXPECT_EQ(latentkv::tools::distinct_selected_entries({}, 2, 4, 13), 0);
  const std::vector<std::int32_t> padding(8, -1);
  EXPECT_EQ(latentkv::tools::distinct_selected_entries(padding, 2, 4, 13), 0);
  EXPECT_THROW((void)latentkv::tools::distinct_selected_entries(rows, 2, 4, 12), std::invalid_argument);  // slot 12
}

TEST(BenchWork, RotationHoldsTwiceTheL2WithinTheCallsAndThePool) {
  using latentkv::tools::kAnySets;
  using latentkv::tools::plan_rotation;
  constexpr std::int64_t kL2 = 50 << 20;
  constexpr int kCalls = 55;  // 5 warm-up + 50 timed
  // A call that reads twice the L2 or more: one set.
  EXPECT_EQ(plan_rotation(2 * kL2, kL2, kCalls, kAnySets).sets, 1);
  EXPECT_TRUE(plan_rotation(2 * kL2, kL2, kCalls, kAnySets).cold);
  // 21.5 MB a call (decode B 1 x 32K): ceil(100 MiB / 21.5 MB) = 5 sets.
  EXPECT_EQ(plan_rotation(21'500'000, kL2, kCalls, kAnySets).sets, 5);
  // 512 KB a call (top-k's logits at B 1 x 128K): 200 sets wanted, the calls cap it at 55.
  const latentkv::tools::Rotation many = plan_rotation(512 << 10, kL2, kCalls, kAnySets);
  EXPECT_EQ(many.sets, kCalls);
  EXPECT_TRUE(many.cold);
  // A pool with room for 3 sets where 5 are wanted: 3, and not cold.
  const latentkv::tools::Rotation held = plan_rotation(21'500'000, kL2, kCalls, 3);
  EXPECT_EQ(held.sets, 3);
  EXPECT_FALSE(held.cold);
  EXPECT_EQ(plan_rotation(21'500'000, kL2, kCalls, 0).sets, 1);  // at least one, never 0
  // No L2 reported (or a negative size): one set, cold; no calls: one set.
  EXPECT_EQ(plan_rotation(1000, 0, kCalls, kAnySets).sets, 1);
  EXPECT_TRUE(plan_rotation(1000, 0, kCalls, 1).cold);
  EXPECT_EQ(plan_rotation(1000, -kL2, kCalls, kAnySets).sets, 1);
  EXPECT_TRUE(plan_rotation(1000, -kL2, kCalls, 1).cold);
  EXPECT_EQ(plan_rotation(1000, kL2, 0, kAnySets).sets, 1);
  // Nothing read counts as a byte a call: as many sets as calls.
  EXPECT_EQ(plan_rotation(0, kL2, kCalls, kAnySets).sets, kCalls);
}

TEST(BenchWork, RequestSetsLeaveAPageOfSlackPerRequest) {
  // 64 requests of 8K tokens on pages of 64: 64 x (8192 + 64) tokens a set.
  EXPECT_EQ(latentkv::tools::request_sets_that_fit(1'100'000, 64 * 8192, 64, 64), 2);
  EXPECT_EQ(latentkv::tools::request_sets_that_fit(64 * (8192 + 64) - 1, 64 * 8192, 64, 64), 0);
  EXPECT_EQ(latentkv::tools::request_sets_that_fit(495'000, 32'768, 1, 64), 15);  // 495K / 32,832
  EXPECT_EQ(latentkv::tools::request_sets_that_fit(495'000, 0, 0, 64), latentkv::tools::kAnySets);  // sets of nothing
}

TEST(BenchWork, SelectedEntriesMatchASetOverRandomRows) {
  // Rows of three requests of 5 rows of top-k 300 over a pool of 1000 slots (many repeats, slots
  // around the bitmap's 64-slot words, -1 padding, a last request cut short), against std::set.
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::int32_t> slot(-1, 999);
  std::vector<std::int32_t> rows(3 * 5 * 300 - 123);
  for (std::int32_t& r : rows) r = slot(rng);
  rows[10] = 63;
  rows[11] = 64;
  rows[12] = 999;
  std::int64_t expected = 0;
  for (std::size_t start = 0; start < rows.size(); start += 5 * 300) {
    std::set<std::int32_t> distinct;
    for (std::size_t i = start; i < std::min(rows.size(), start + 5 * 300); ++i) {
      if (rows[i] >= 0) distinct.insert(rows[i]);
    }
    expected += static_cast<std::int64_t>(distinct.size());
  }
  EXPECT_EQ(latentkv::tools::distinct_selected_entries(rows, 5, 300, 1000), expected);
}

}  // namespace
