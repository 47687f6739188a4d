// Calls from several threads at once, as an engine's workers make them (docs/operations.md): the
// library keeps no state of a call outside the caller's buffers (outputs, workspace), so threads
// that share one read-only cache and plan and call the same backend each get, bit for bit, what one
// thread alone computes; loading and resolving configurations and looking backends up may race too.
// Built with -fsanitize=thread (scripts/test.sh), these tests are also the data-race check of those
// paths on the CPU build; the CUDA backends' shared host state (once_per_key, behind a mutex) is
// exercised by GpuDsaDecodeThreads on a GPU, not under ThreadSanitizer.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "latentkv/backend.hpp"
#include "latentkv/config.hpp"
#include "latentkv/dsa.hpp"
#include "support/host_tensor.hpp"
#include "support/paged_fixture.hpp"
#include "support/reference_ops.hpp"

namespace latentkv::testing {
namespace {

constexpr int kThreads = 4;
constexpr int kHeads = 8;
constexpr int kIndexerHeads = 32;
constexpr int kTopk = 256;
const DeviceInfo kCpu{};

const Backend& reference() { return *find_backend("reference"); }

// One worker's inputs, drawn once.
struct Inputs {
  HostTensor q, q_idx, weights;
  Inputs(Rng& rng, const PagedFixture& f)
      : q(random_bf16(rng, {f.batch(), 1, kHeads, kQkDim})),
        q_idx(random_fp8(rng, {f.batch(), 1, kIndexerHeads, kIndexerDim})),
        weights(random_f32(rng, {f.batch(), 1, kIndexerHeads}, -1.0, 1.0)) {}
};

// One dsa_decode call over the shared fixture: its inputs, and outputs and a workspace of its own.
struct Call {
  HostTensor o, lse;
  DsaDecodeParams params;
  DsaPlan plan;
  std::vector<std::uint8_t> workspace;

  Call(const Inputs& in, PagedFixture& f)
      : o(sentinel_tensor(DType::kBF16, {f.batch(), 1, kHeads, kLatentDim})),
        lse(sentinel_tensor(DType::kF32, {f.batch(), 1, kHeads})) {
    params = dsa_decode_args(f, in.q, in.q_idx, in.weights, o, lse, 0.0625f, kTopk);
    plan = plan_dsa_decode(same_backend(reference()), params, kCpu);
    workspace.assign(plan.workspace_bytes, 0xA5);
    params.workspace = workspace.data();
    params.workspace_bytes = workspace.size();
  }

  void run() { dsa_decode(same_backend(reference()), params, plan, {}, kCpu); }
  std::vector<std::uint8_t> result() const {
    std::vector<std::uint8_t> bytes = o.byte_vector();
    const std::vector<std::uint8_t> l = lse.byte_vector();
    bytes.insert(bytes.end(), l.begin(), l.end());
    return bytes;
  }
};

TEST(Concurrency, DsaDecodeFromManyThreadsEqualsOneThreadBitForBit) {
  Rng rng = test_rng();
  PagedFixtureOptions options;
  options.page_size = 64;
  options.lengths = {0, 1, 200, 700, 1030};  // past the top-k, so that it selects
  PagedFixture f = make_paged_fixture(options, rng);
  std::vector<Inputs> inputs;
  for (int t = 0; t < kThreads; ++t) inputs.emplace_back(rng, f);

  std::vector<std::vector<std::uint8_t>> alone;
  for (const Inputs& in : inputs) {
    Call call(in, f);
    call.run();
    alone.push_back(call.result());
    ASSERT_FALSE(is_sentinel(call.o));
  }
  for (int round = 0; round < 3; ++round) {
    std::vector<std::unique_ptr<Call>> calls(inputs.size());
    std::vector<std::thread> threads;
    for (std::size_t t = 0; t < inputs.size(); ++t) {
      threads.emplace_back([&, t] {  // each thread plans its call too
        calls[t] = std::make_unique<Call>(inputs[t], f);
        calls[t]->run();
      });
    }
    for (std::thread& t : threads) t.join();
    for (std::size_t t = 0; t < calls.size(); ++t) {
      EXPECT_EQ(calls[t]->result(), alone[t]) << "thread " << t << ", round " << round;
    }
  }
  EXPECT_TRUE(unread_slots_poisoned(f));
}

TEST(Concurrency, ConfigurationsResolveAndBackendsAreFoundFromManyThreads) {
  const ResolvedConfig alone = resolve_config(load_config({}), kCpu);
  std::vector<std::string> chosen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t, &chosen] {
      std::string names;
      for (int i = 0; i < 20; ++i) {
        const AttentionConfig config = load_config({{FlagValue{"tp", t % 2 == 0 ? "8" : "4"}}, {}});
        const ResolvedConfig r = resolve_config(config, kCpu);
        names = std::string(r.slot(Slot::kSparseDecode).backend->name()) + "/" + std::to_string(r.shard.heads_per_gpu);
        if (find_backend("reference") == nullptr) names = "no reference backend";
      }
      chosen[static_cast<std::size_t>(t)] = names;
    });
  }
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(chosen[static_cast<std::size_t>(t)], std::string(alone.slot(Slot::kSparseDecode).backend->name()) + "/" +
                                                       (t % 2 == 0 ? "8" : "16"));
  }
}

}  // namespace
}  // namespace latentkv::testing
