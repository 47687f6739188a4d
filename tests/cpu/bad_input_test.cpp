// Rejected inputs: each throws latentkv::Error naming the op, the argument and the value, and a
// rejected call writes nothing (caches and output sentinels are byte-identical afterwards).
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/validate.hpp"
#include "cpu/reference.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/model.hpp"
#include "support/expect_error.hpp"
#include "support/gpu_only.hpp"
#include "support/reference_ops.hpp"

namespace latentkv::testing {
namespace {

constexpr std::uint16_t kBf16Nan = 0x7FC0;
constexpr std::uint16_t kBf16Inf = 0x7F80;

// A small fixture and an append of three new tokens into free slots of it.
struct AppendCase {
  Rng rng;
  PagedFixture f;
  HostTensor latent, keys, slots;
  std::vector<std::uint8_t> cache_before, indexer_before;

  explicit AppendCase(KvDtype kv_dtype = KvDtype::kFp8E4M3)
      : rng(test_rng()),
        f(make_paged_fixture(options(kv_dtype), rng)),
        latent(random_bf16(rng, {3, kQkDim})),
        keys(random_bf16(rng, {3, kIndexerDim})),
        slots(DType::kI32, {3}) {
    // Three slots of the pool no request uses.
    std::int32_t next = 0;
    for (int i = 0; i < 3; ++i) {
      while (used(next)) ++next;
      slots.data<std::int32_t>()[i] = next++;
    }
  }
  static PagedFixtureOptions options(KvDtype kv_dtype) {
    PagedFixtureOptions o;
    o.page_size = 4;
    o.lengths = {5, 2};
    o.spare_pages = 2;
    o.kv_dtype = kv_dtype;
    return o;
  }
  bool used(std::int32_t slot) const {
    for (std::int64_t b = 0; b < f.batch(); ++b) {
      for (std::int32_t s : f.slots(b, f.seq_lens[static_cast<std::size_t>(b)])) {
        if (s == slot) return true;
      }
    }
    return false;
  }
  AppendParams params() {
    cache_before = f.cache_bytes;
    indexer_before = f.indexer_bytes;
    AppendParams p;
    p.cache = f.cache();
    p.latent = latent.view();
    p.slots = slots.view();
    p.indexer = f.indexer();
    p.indexer_keys = keys.view();
    return p;
  }
  ::testing::AssertionResult unchanged() const {
    if (f.cache_bytes != cache_before) return ::testing::AssertionFailure() << "the main cache changed";
    if (f.indexer_bytes != indexer_before) return ::testing::AssertionFailure() << "the indexer cache changed";
    return ::testing::AssertionSuccess();
  }
};

TEST(BadInput, AppendSlotOutsideThePool) {
  AppendCase c;
  const std::int64_t num_slots = c.f.num_pages() * c.f.page_size;
  // The bad slot is the last token: the first two must not have been written either.
  c.slots.data<std::int32_t>()[2] = static_cast<std::int32_t>(num_slots);
  AppendParams p = c.params();
  EXPECT_TRUE(throws_error([&] { cpu::append(p); }, "append", "slots element 2", std::to_string(num_slots)));
  EXPECT_NE(error_of([&] { cpu::append(p); }).find("a slot in 0 .. " + std::to_string(num_slots - 1)),
            std::string::npos);
  EXPECT_TRUE(c.unchanged());
  c.slots.data<std::int32_t>()[2] = -2;
  p = c.params();
  EXPECT_TRUE(throws_error([&] { cpu::append(p); }, "append", "slots element 2", "-2"));
  EXPECT_TRUE(c.unchanged());
}

// Two tokens of one append at one slot have no defined entry (a GPU may mix their bytes): the
// reference refuses the call, naming the first repeat in the call's order and the element it
// repeats, before writing anything. Skipped tokens (-1) may repeat.
TEST(BadInput, AppendSlotGivenTwice) {
  AppendCase c(KvDtype::kFp8E4M3);
  c.latent = random_bf16(c.rng, {5, kQkDim});
  c.keys = random_bf16(c.rng, {5, kIndexerDim});
  const std::int32_t a = c.slots.data<std::int32_t>()[0], b = c.slots.data<std::int32_t>()[1];
  c.slots = HostTensor(DType::kI32, {5});
  auto set = [&](std::initializer_list<std::int32_t> slots) {
    std::copy(slots.begin(), slots.end(), c.slots.data<std::int32_t>());
  };
  set({b, a, -1, a, b});  // element 3 repeats element 1 (and 4 repeats 0, later in the call)
  AppendParams p = c.params();
  EXPECT_TRUE(throws_error([&] { cpu::append(p); }, "append", "slots element 3", std::to_string(a)));
  EXPECT_NE(error_of([&] { cpu::append(p); }).find("(element 1 has it too;"), std::string::npos);
  EXPECT_TRUE(c.unchanged());
  set({a, -1, b, -1, -1});
  p = c.params();
  EXPECT_NO_THROW(cpu::append(p));
}

TEST(BadInput, AppendNanOrInfLatentOrKeys) {
  AppendCase c;
  c.latent.data<std::uint16_t>()[2 * kQkDim + 100] = kBf16Nan;
  AppendParams p = c.params();
  EXPECT_TRUE(throws_error([&] { cpu::append(p); }, "append", "latent element " + std::to_string(2 * kQkDim + 100), "nan"));
  EXPECT_TRUE(c.unchanged());

  c.latent.data<std::uint16_t>()[2 * kQkDim + 100] = 0;
  c.latent.data<std::uint16_t>()[kQkDim + 570] = kBf16Inf;  // in the rope part
  p = c.params();
  EXPECT_TRUE(throws_error([&] { cpu::append(p); }, "append", "latent element " + std::to_string(kQkDim + 570), "inf"));
  EXPECT_TRUE(c.unchanged());

  c.latent.data<std::uint16_t>()[kQkDim + 570] = 0;
  c.keys.data<std::uint16_t>()[2 * kIndexerDim + 5] = kBf16Nan;
  p = c.params();
  EXPECT_TRUE(throws_error([&] { cpu::append(p); }, "append", "indexer_keys element " + std::to_string(2 * kIndexerDim + 5), "nan"));
  EXPECT_TRUE(c.unchanged());

  c.keys.data<std::uint16_t>()[2 * kIndexerDim + 5] = 0;
  p = c.params();
  EXPECT_NO_THROW(cpu::append(p));
  EXPECT_FALSE(c.unchanged());
}

// Under pow2 scales (SPEC section 3) a block holding a value of magnitude 248 x 2^120 or more gets
// the scale 2^120, and the value the fp8 code 256: it would read back as 2^128, inf in float32. Such
// values are refused in the quantized parts (the latent's 512, the indexer key), and stored where
// they are kept as they are (the rope, a bf16 cache) or the scale is exact.
TEST(BadInput, AppendValuesPow2ScalesCannotHold) {
  constexpr std::uint16_t kTooLarge = kPow2StorableMagnitudeBits;              // 248 x 2^120
  constexpr std::uint16_t kLargest = kPow2StorableMagnitudeBits - 1;           // 247 x 2^120: code 240
  AppendCase c;
  c.latent.data<std::uint16_t>()[kQkDim + 7] = 0x8000u | kTooLarge;  // negative: the magnitude counts
  AppendParams p = c.params();
  EXPECT_TRUE(throws_error([&] { cpu::append(p); }, "append", "latent element " + std::to_string(kQkDim + 7),
                           "-3.29649e+38"));
  EXPECT_NE(error_of([&] { cpu::append(p); }).find("a magnitude below 248 x 2^120"), std::string::npos);
  EXPECT_TRUE(c.unchanged());

  c.latent.data<std::uint16_t>()[kQkDim + 7] = 0;
  c.keys.data<std::uint16_t>()[kIndexerDim + 3] = kTooLarge;
  p = c.params();
  EXPECT_TRUE(throws_error([&] { cpu::append(p); }, "append", "indexer_keys element " + std::to_string(kIndexerDim + 3),
                           "3.29649e+38"));
  EXPECT_TRUE(c.unchanged());
  p.scale_mode = ScaleMode::kExact;  // an exact scale holds it
  EXPECT_NO_THROW(cpu::append(p));

  AppendCase e;  // the latent's last quantized element
  e.latent.data<std::uint16_t>()[kLatentDim - 1] = kTooLarge;
  p = e.params();
  EXPECT_TRUE(throws_error([&] { cpu::append(p); }, "append", "latent element " + std::to_string(kLatentDim - 1),
                           "3.29649e+38"));
  EXPECT_TRUE(e.unchanged());

  // The largest value a pow2 block holds, in the latent and the key; and a larger one in the rope.
  AppendCase d;
  d.latent.data<std::uint16_t>()[5] = kLargest;
  d.latent.data<std::uint16_t>()[kLatentDim] = kTooLarge;  // the rope's first dim
  d.latent.data<std::uint16_t>()[kLatentDim + 1] = kTooLarge;
  d.keys.data<std::uint16_t>()[0] = 0x8000u | kLargest;
  p = d.params();
  ASSERT_NO_THROW(cpu::append(p));
  const std::int64_t slot = d.slots.data<std::int32_t>()[0];
  double entry[kQkDim], key[kIndexerDim], key_scale = 0;
  cpu::dequantize_token(p.cache, slot, entry);
  cpu::dequantize_indexer_key(p.indexer, slot, key, &key_scale);
  EXPECT_EQ(entry[5], 240.0 * std::ldexp(1.0, 120));
  EXPECT_EQ(entry[kLatentDim], static_cast<double>(bf16_decode(kTooLarge)));
  EXPECT_EQ(entry[kLatentDim + 1], static_cast<double>(bf16_decode(kTooLarge)));
  EXPECT_EQ(key[0] * key_scale, -240.0 * std::ldexp(1.0, 120));

  // A bf16 cache stores its latent as given, under pow2 scales too (the indexer key is still fp8).
  AppendCase b(KvDtype::kBf16);
  b.latent.data<std::uint16_t>()[5] = kTooLarge;
  p = b.params();
  ASSERT_NO_THROW(cpu::append(p));
  cpu::dequantize_token(p.cache, b.slots.data<std::int32_t>()[0], entry);
  EXPECT_EQ(entry[5], static_cast<double>(bf16_decode(kTooLarge)));
}

TEST(BadInput, AppendMismatchedIndexerCache) {
  AppendCase c;
  AppendParams p = c.params();
  p.indexer.page_size = 8;
  EXPECT_TRUE(throws_error([&] { cpu::append(p); }, "append", "indexer.page_size", "8"));
  EXPECT_TRUE(c.unchanged());
}

// A decode over a small fixture with sentinel outputs.
// indexer_prefill of q [T, Hi, 128] and weights [T, Hi] with offsets `cu` over `cache`, its slots
// [T, k] written to `slots`.
IndexerPrefillParams indexer_prefill_params(HostTensor& q, HostTensor& weights, std::vector<std::int32_t>& cu,
                                            const IndexerCache& cache, const TensorView& block_table,
                                            const TensorView& seq_lens, HostTensor& slots) {
  IndexerPrefillParams p;
  p.q = q.view();
  p.weights = weights.view();
  p.cu_new_tokens = TensorView::contiguous(cu.data(), DType::kI32, {static_cast<std::int64_t>(cu.size())});
  p.cache = cache;
  p.block_table = block_table;
  p.seq_lens = seq_lens;
  p.k = slots.shape()[1];
  p.slots = slots.view();
  return p;
}

struct DecodeCase {
  Rng rng;
  PagedFixture f;
  HostTensor q, o, lse;
  std::vector<std::int32_t> table, lens;

  explicit DecodeCase(int heads = 4)
      : rng(test_rng()),
        f(make_paged_fixture(options(), rng)),
        q(random_bf16(rng, {2, 1, heads, kQkDim})),
        o(sentinel_tensor(DType::kBF16, {2, 1, heads, kLatentDim})),
        lse(sentinel_tensor(DType::kF32, {2, 1, heads})),
        table(f.block_table),
        lens(f.seq_lens) {}
  static PagedFixtureOptions options() {
    PagedFixtureOptions o;
    o.page_size = 4;
    o.lengths = {9, 3};
    o.with_indexer = true;
    return o;
  }
  MlaDecodeParams params() {
    MlaDecodeParams p;
    p.q = q.view();
    p.cache = f.cache();
    p.block_table = TensorView::contiguous(table.data(), DType::kI32, {2, f.max_pages});
    p.seq_lens = TensorView::contiguous(lens.data(), DType::kI32, {2});
    p.o = o.view();
    p.lse = lse.view();
    p.softmax_scale = 0.0625f;
    return p;
  }
  bool outputs_untouched() const { return is_sentinel(o) && is_sentinel(lse); }
  // The other ops over the same fixture (its own block table and lengths for prefill and top-k).
  SparseMlaDecodeParams sparse_params(HostTensor& indices) {
    return sparse_args<SparseMlaDecodeParams>(q, indices, o, lse);
  }
  SparseMlaPrefillParams sparse_prefill_params(HostTensor& new_q, HostTensor& indices, HostTensor& new_o,
                                               HostTensor& new_lse) {
    return sparse_args<SparseMlaPrefillParams>(new_q, indices, new_o, new_lse);
  }
  // Sparse decode and prefill take the same fields (their shapes differ by the q_len dim).
  template <typename Params>
  Params sparse_args(HostTensor& q_in, HostTensor& indices, HostTensor& o_out, HostTensor& lse_out) {
    Params p;
    p.q = q_in.view();
    p.cache = f.cache();
    p.indices = indices.view();
    p.o = o_out.view();
    p.lse = lse_out.view();
    p.softmax_scale = 0.0625f;
    return p;
  }
  MlaPrefillParams prefill_params(HostTensor& new_q, std::vector<std::int32_t>& cu, HostTensor& new_o,
                                  HostTensor& new_lse) {
    MlaPrefillParams p;
    p.q = new_q.view();
    p.cu_new_tokens = TensorView::contiguous(cu.data(), DType::kI32, {static_cast<std::int64_t>(cu.size())});
    p.cache = f.cache();
    p.block_table = f.block_table_view();
    p.seq_lens = f.seq_lens_view();
    p.o = new_o.view();
    p.lse = new_lse.view();
    p.softmax_scale = 0.0625f;
    return p;
  }
  TopkParams topk_params(HostTensor& logits, HostTensor& slots, int k) {
    TopkParams p;
    p.logits = logits.view();
    p.block_table = f.block_table_view();
    p.seq_lens = f.seq_lens_view();
    p.page_size = f.page_size;
    p.k = k;
    p.slots = slots.view();
    return p;
  }
};

TEST(BadInput, DecodeBlockTableOutsideThePool) {
  DecodeCase c;
  const MlaDecodeParams good = c.params();
  EXPECT_NO_THROW(cpu::mla_decode(good));  // the case itself is valid
  fill_sentinel(c.o);
  fill_sentinel(c.lse);

  c.table[static_cast<std::size_t>(2)] = static_cast<std::int32_t>(c.f.num_pages());  // request 0's third page
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(c.params()); }, "mla_decode", "block_table[0][2]",
                           std::to_string(c.f.num_pages())));
  EXPECT_TRUE(c.outputs_untouched());
  c.table[2] = -1;
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(c.params()); }, "mla_decode", "block_table[0][2]", "-1"));
  EXPECT_TRUE(c.outputs_untouched());

  // The allocator also knows which pages are handed out at all.
  c.table = c.f.block_table;
  std::int32_t spare = 0;
  while (std::find(c.f.block_table.begin(), c.f.block_table.end(), spare) != c.f.block_table.end()) ++spare;
  c.table[static_cast<std::size_t>(c.f.max_pages)] = spare;  // request 1's first page: a free one
  EXPECT_TRUE(throws_error([&] { c.f.allocator.check_block_table("mla_decode", c.table.data(), 2, c.f.max_pages, c.lens.data()); },
                           "mla_decode", "block_table[1][0]", std::to_string(spare)));
}

TEST(BadInput, DecodeLengthBeyondCapacity) {
  DecodeCase c;
  const std::int64_t capacity = static_cast<std::int64_t>(c.f.max_pages) * c.f.page_size;
  c.lens[1] = static_cast<std::int32_t>(capacity + 1);
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(c.params()); }, "mla_decode", "seq_lens[1]", std::to_string(capacity + 1)));
  EXPECT_TRUE(c.outputs_untouched());
  c.lens[1] = -1;
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(c.params()); }, "mla_decode", "seq_lens[1]", "-1"));
  EXPECT_TRUE(c.outputs_untouched());
}

TEST(BadInput, DecodeNanOrInfQuery) {
  DecodeCase c;
  c.q.data<std::uint16_t>()[777] = kBf16Nan;
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(c.params()); }, "mla_decode", "q element 777", "nan"));
  EXPECT_TRUE(c.outputs_untouched());
  c.q.data<std::uint16_t>()[777] = 0xFF80;  // -inf, named with its sign
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(c.params()); }, "mla_decode", "q element 777", "-inf"));
  EXPECT_TRUE(c.outputs_untouched());
  c.q.data<std::uint16_t>()[777] = 0;
  c.q.data<std::uint16_t>()[0] = kBf16Nan;  // the first element is checked too
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(c.params()); }, "mla_decode", "q element 0", "nan"));
  EXPECT_TRUE(c.outputs_untouched());
}

TEST(BadInput, DecodeTooManyHeadsOrLongQuery) {
  DecodeCase c(129);
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(c.params()); }, "mla_decode", "heads", "129"));
  EXPECT_TRUE(c.outputs_untouched());
  DecodeCase none(0);  // no heads: q, o and lse of no elements, refused by the head count
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(none.params()); }, "mla_decode", "q.shape[2] (heads)", "0"));

  DecodeCase d;
  MlaDecodeParams p = d.params();
  p.softmax_scale = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(p); }, "mla_decode", "softmax_scale", "nan"));
  HostTensor q5 = random_bf16(d.rng, {2, 5, 4, kQkDim});
  p = d.params();
  p.q = q5.view();
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(p); }, "mla_decode", "q_len", "5"));
  EXPECT_TRUE(d.outputs_untouched());
}

// o and lse shaped as q says ([B, q_len, H, 512] and [B, q_len, H]), dense and sparse alike.
TEST(BadInput, DecodeOutputsOfTheWrongShape) {
  DecodeCase c;
  HostTensor o3 = sentinel_tensor(DType::kBF16, {2, 1, 3, kLatentDim});  // a head short of q's 4
  MlaDecodeParams p = c.params();
  p.o = o3.view();
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(p); }, "mla_decode", "o", "[2, 1, 3, 512]"));
  EXPECT_NE(error_of([&] { cpu::mla_decode(p); }).find("[2, 1, 4, 512]"), std::string::npos);
  HostTensor lse4 = sentinel_tensor(DType::kF32, {2, 1, 4, 1});  // a rank too many
  p = c.params();
  p.lse = lse4.view();
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(p); }, "mla_decode", "lse", "[2, 1, 4, 1]"));
  EXPECT_TRUE(c.outputs_untouched() && is_sentinel(o3) && is_sentinel(lse4));

  HostTensor idx = i32_tensor({2, 1, 3}, {0, -1, -1, 0, -1, -1});
  HostTensor o2 = sentinel_tensor(DType::kBF16, {2, 2, 4, kLatentDim});  // q_len 2 where q has 1
  SparseMlaDecodeParams sp = c.sparse_params(idx);
  sp.o = o2.view();
  EXPECT_TRUE(throws_error([&] { cpu::sparse_mla_decode(sp); }, "sparse_mla_decode", "o", "[2, 2, 4, 512]"));
  EXPECT_TRUE(c.outputs_untouched() && is_sentinel(o2));
}

// A typed view whose address is not a multiple of its element size is refused before anything
// reads or writes through it (the reference would otherwise access misaligned bf16, f32 and int32
// elements: undefined behaviour), naming the view; fp8 bytes need no alignment.
TEST(BadInput, ViewsAtAddressesTheirElementsDoNotAlign) {
  DecodeCase c;
  MlaDecodeParams p = c.params();
  const auto shifted = [](std::vector<std::uint8_t>& bytes, const HostTensor& t) {
    const std::vector<std::uint8_t> held = t.byte_vector();
    bytes.assign(held.size() + 16, 0);
    std::copy(held.begin(), held.end(), bytes.begin() + 1);
    return TensorView::contiguous(bytes.data() + 1, t.dtype(), t.shape());
  };
  // The error names the view and its address, and asks for the element size's alignment.
  const auto refused = [&](auto call, const char* arg, int element) {
    return throws_error(call, "mla_decode", arg, "an address not " + std::to_string(element) + "-byte aligned (0x") &&
           error_of(call).find("an address aligned to " + std::to_string(element) + " bytes") != std::string::npos;
  };
  std::vector<std::uint8_t> q_bytes, o_bytes, lse_bytes;
  p.q = shifted(q_bytes, c.q);
  EXPECT_TRUE(refused([&] { cpu::mla_decode(p); }, "q", 2));
  p = c.params();
  p.o = shifted(o_bytes, c.o);
  EXPECT_TRUE(refused([&] { run(*find_backend("reference"), p); }, "o", 2));
  p = c.params();
  p.lse = shifted(lse_bytes, c.lse);
  EXPECT_TRUE(refused([&] { cpu::mla_decode(p); }, "lse", 4));
  p = c.params();
  std::vector<std::int32_t> lens(c.lens.size() + 1);
  auto* at = reinterpret_cast<std::uint8_t*>(lens.data()) + 2;
  std::memcpy(at, c.lens.data(), c.lens.size() * sizeof(std::int32_t));
  p.seq_lens = TensorView::contiguous(at, DType::kI32, {2});
  EXPECT_TRUE(refused([&] { cpu::mla_decode(p); }, "seq_lens", 4));
  EXPECT_TRUE(c.outputs_untouched());
  EXPECT_TRUE(std::equal(c.o.byte_vector().begin(), c.o.byte_vector().end(), o_bytes.begin() + 1));  // still sentinels
  EXPECT_TRUE(std::equal(c.lse.byte_vector().begin(), c.lse.byte_vector().end(), lse_bytes.begin() + 1));
}

TEST(BadInput, PrefillRaggedOffsets) {
  DecodeCase c;
  HostTensor q = random_bf16(c.rng, {4, 4, kQkDim});
  HostTensor o = sentinel_tensor(DType::kBF16, {4, 4, kLatentDim});
  HostTensor lse = sentinel_tensor(DType::kF32, {4, 4});
  std::vector<std::int32_t> cu = {0, 4, 4};  // request 1 has 3 tokens; fine. Request 0: 4 of 9.
  MlaPrefillParams p = c.prefill_params(q, cu, o, lse);
  EXPECT_NO_THROW(cpu::mla_prefill(p));
  fill_sentinel(o);
  fill_sentinel(lse);
  std::vector<std::int32_t> over = {0, 0, 4};  // request 1 would have 4 new tokens but has 3 tokens in all
  p.cu_new_tokens = TensorView::contiguous(over.data(), DType::kI32, {3});
  EXPECT_TRUE(throws_error([&] { cpu::mla_prefill(p); }, "mla_prefill", "cu_new_tokens[2]", "4"));
  std::vector<std::int32_t> descending = {0, 5, 4};  // request 1 would have -1 new tokens
  p.cu_new_tokens = TensorView::contiguous(descending.data(), DType::kI32, {3});
  EXPECT_TRUE(throws_error([&] { cpu::mla_prefill(p); }, "mla_prefill", "cu_new_tokens[2]", "4"));
  EXPECT_NE(error_of([&] { cpu::mla_prefill(p); }).find("5 .. 8 (request 1 has 3 tokens in all)"), std::string::npos);
  std::vector<std::int32_t> short_rows = {0, 1, 3};  // does not cover the 4 rows of q
  p.cu_new_tokens = TensorView::contiguous(short_rows.data(), DType::kI32, {3});
  EXPECT_TRUE(throws_error([&] { cpu::mla_prefill(p); }, "mla_prefill", "cu_new_tokens[2]", "3"));
  EXPECT_TRUE(is_sentinel(o) && is_sentinel(lse));
}

TEST(BadInput, SparseIndexOutsideThePool) {
  DecodeCase c;
  const std::int64_t num_slots = c.f.num_pages() * c.f.page_size;
  HostTensor idx = i32_tensor({2, 1, 3}, {0, -1, 1, 2, static_cast<std::int32_t>(num_slots), -1});
  const SparseMlaDecodeParams p = c.sparse_params(idx);
  EXPECT_TRUE(throws_error([&] { cpu::sparse_mla_decode(p); }, "sparse_mla_decode", "indices element 4", std::to_string(num_slots)));
  EXPECT_TRUE(c.outputs_untouched());
  idx.data<std::int32_t>()[4] = -7;
  EXPECT_TRUE(throws_error([&] { cpu::sparse_mla_decode(p); }, "sparse_mla_decode", "indices element 4", "-7"));
  EXPECT_TRUE(c.outputs_untouched());

  HostTensor qp = random_bf16(c.rng, {2, 4, kQkDim});
  HostTensor op = sentinel_tensor(DType::kBF16, {2, 4, kLatentDim}), lp = sentinel_tensor(DType::kF32, {2, 4});
  HostTensor idxp = i32_tensor({2, 2}, {3, static_cast<std::int32_t>(num_slots + 5)});
  const SparseMlaPrefillParams pp = c.sparse_prefill_params(qp, idxp, op, lp);
  EXPECT_TRUE(throws_error([&] { cpu::sparse_mla_prefill(pp); }, "sparse_mla_prefill", "indices element 1",
                           std::to_string(num_slots + 5)));
  EXPECT_TRUE(is_sentinel(op) && is_sentinel(lp));
  HostTensor one_row = i32_tensor({1, 2}, {3, -1});  // q has 2 rows
  SparseMlaPrefillParams rows = c.sparse_prefill_params(qp, one_row, op, lp);
  EXPECT_TRUE(throws_error([&] { cpu::sparse_mla_prefill(rows); }, "sparse_mla_prefill", "indices", "[1, 2]"));
  EXPECT_TRUE(is_sentinel(op) && is_sentinel(lp));
  qp.data<std::uint16_t>()[3] = kBf16Nan;
  idxp.data<std::int32_t>()[1] = -1;
  EXPECT_TRUE(throws_error([&] { cpu::sparse_mla_prefill(pp); }, "sparse_mla_prefill", "q element 3", "nan"));
  EXPECT_TRUE(is_sentinel(op) && is_sentinel(lp));
}

// A GPU op's fault record, as a kernel writes it for a bad input, throws the very Error the
// reference throws for the same input: every code, for the ops that report it.
DeviceFault record(DeviceFaultOp op, DeviceFaultCode code, DeviceFault fields) {
  fields.code = static_cast<std::int32_t>(code);
  fields.op = static_cast<std::int32_t>(op);
  return fields;
}
std::string record_error(const DeviceFault& f) {
  return error_of([&] { throw_device_fault(f); });
}

TEST(BadInput, DeviceFaultsThrowTheReferencesErrors) {
  using Op = DeviceFaultOp;
  using Code = DeviceFaultCode;
  AppendCase a;
  const std::int64_t num_slots = a.f.num_pages() * a.f.page_size;
  a.slots.data<std::int32_t>()[1] = static_cast<std::int32_t>(num_slots + 3);
  EXPECT_EQ(record_error(record(Op::kAppend, Code::kSlot, {.index = 1, .value = num_slots + 3, .bound = num_slots})),
            error_of([&] { cpu::append(a.params()); }));
  a.slots.data<std::int32_t>()[1] = -1;
  const std::int64_t element = kQkDim + 570;  // in the rope part
  a.latent.data<std::uint16_t>()[element] = kBf16Inf;
  EXPECT_EQ(record_error(record(Op::kAppend, Code::kLatent, {.index = element, .value = kBf16Inf})),
            error_of([&] { cpu::append(a.params()); }));
  a.latent.data<std::uint16_t>()[element] = 0;
  a.keys.data<std::uint16_t>()[2 * kIndexerDim + 5] = kBf16Nan;
  EXPECT_EQ(record_error(record(Op::kAppend, Code::kIndexerKey, {.index = 2 * kIndexerDim + 5, .value = kBf16Nan})),
            error_of([&] { cpu::append(a.params()); }));

  DecodeCase c;
  const std::int64_t pages = c.f.max_pages, page_size = c.f.page_size, capacity = pages * page_size;
  c.lens[1] = static_cast<std::int32_t>(capacity + 1);
  EXPECT_EQ(record_error(record(Op::kMlaDecode, Code::kSeqLen,
                                {.index = 1, .value = capacity + 1, .pages = pages, .page_size = page_size})),
            error_of([&] { cpu::mla_decode(c.params()); }));
  c.lens = c.f.seq_lens;
  c.table[2] = -4;  // request 0 (9 tokens): its third page
  EXPECT_EQ(record_error(record(Op::kMlaDecode, Code::kBlockTablePage,
                                {.index = 0, .position = 2, .value = -4, .bound = c.f.num_pages(), .length = 9,
                                 .page_size = page_size})),
            error_of([&] { cpu::mla_decode(c.params()); }));
  c.table = c.f.block_table;

  HostTensor idx = i32_tensor({2, 1, 3}, {0, -1, 1, 2, -7, -1});
  const SparseMlaDecodeParams sp = c.sparse_params(idx);
  EXPECT_EQ(record_error(record(Op::kSparseMlaDecode, Code::kSlot, {.index = 4, .value = -7, .bound = c.f.num_pages() * page_size})),
            error_of([&] { cpu::sparse_mla_decode(sp); }));

  HostTensor q = random_bf16(c.rng, {4, 4, kQkDim});
  HostTensor o = sentinel_tensor(DType::kBF16, {4, 4, kLatentDim}), lse = sentinel_tensor(DType::kF32, {4, 4});
  const auto prefill_error = [&](std::vector<std::int32_t> cu) {
    return error_of([&] { cpu::mla_prefill(c.prefill_params(q, cu, o, lse)); });
  };
  EXPECT_EQ(record_error(record(Op::kMlaPrefill, Code::kNewTokensStart, {.value = 1})), prefill_error({1, 4, 4}));
  EXPECT_EQ(record_error(record(Op::kMlaPrefill, Code::kNewTokensCount, {.index = 2, .value = 4, .bound = 0, .length = 3})),
            prefill_error({0, 0, 4}));
  EXPECT_EQ(record_error(record(Op::kMlaPrefill, Code::kNewTokensEnd, {.index = 2, .value = 3, .bound = 4})),
            prefill_error({0, 1, 3}));

  HostTensor logits = random_f32(c.rng, {2, 1, 8}, -1, 1);  // 8 columns: request 0's 9 tokens do not fit
  HostTensor slots = sentinel_tensor(DType::kI32, {2, 1, 4});
  const TopkParams tp = c.topk_params(logits, slots, 4);
  EXPECT_EQ(record_error(record(Op::kTopk, Code::kSeqLenColumns, {.index = 0, .value = 9, .bound = 8})),
            error_of([&] { cpu::topk(tp); }));

  EXPECT_EQ(record_error(DeviceFault{}), "");  // a zeroed record: no fault
  EXPECT_TRUE(throws_error([&] { throw_device_fault(record(Op::kTopk, static_cast<Code>(77), {})); }, "device fault", "code", "77"));
  EXPECT_TRUE(throws_error([&] { throw_device_fault(record(static_cast<Op>(0), Code::kSlot, {})); }, "device fault", "op", "0"));
}

// A record no latentkv kernel wrote (one never zeroed, say) can hold any 64-bit value where the
// Error counts with a bound: such a field is named as the record's, not wrapped into a range.
TEST(BadInput, DeviceFaultRecordsOutOfRange) {
  using Op = DeviceFaultOp;
  using Code = DeviceFaultCode;
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  constexpr std::int64_t kMin = std::numeric_limits<std::int64_t>::min();
  const auto refused = [](const DeviceFault& f, std::string_view field, std::int64_t value) {
    return throws_error([&] { throw_device_fault(f); }, "device fault", field, std::to_string(value));
  };
  EXPECT_TRUE(refused(record(Op::kAppend, Code::kSlot, {.index = 1, .value = 5, .bound = kMin}), "bound", kMin));
  EXPECT_TRUE(refused(record(Op::kMlaDecode, Code::kSeqLen, {.value = 9, .pages = kMax, .page_size = 2}), "pages", kMax));
  EXPECT_TRUE(
      refused(record(Op::kMlaDecode, Code::kSeqLen, {.value = 9, .pages = 2, .page_size = kMax}), "page_size", kMax));
  EXPECT_TRUE(refused(record(Op::kMlaDecode, Code::kBlockTablePage, {.value = -4, .bound = kMin, .length = 9, .page_size = 4}),
                      "bound", kMin));
  EXPECT_TRUE(refused(record(Op::kMlaDecode, Code::kBlockTablePage, {.value = -4, .bound = 8, .length = kMax, .page_size = 4}),
                      "length", kMax));
  EXPECT_TRUE(refused(record(Op::kMlaDecode, Code::kBlockTablePage, {.value = -4, .bound = 8, .length = 9, .page_size = kMax}),
                      "page_size", kMax));
  EXPECT_TRUE(refused(record(Op::kMlaPrefill, Code::kNewTokensCount, {.index = 2, .value = 4, .bound = kMax, .length = 3}),
                      "bound", kMax));
  EXPECT_TRUE(refused(record(Op::kMlaPrefill, Code::kNewTokensCount, {.index = 2, .value = 4, .bound = 0, .length = kMax}),
                      "length", kMax));
}

TEST(BadInput, TopkKOutOfRange) {
  DecodeCase c;
  HostTensor logits = random_f32(c.rng, {2, 1, 12}, -1, 1);
  for (int k : {0, -3, 2049, 4096}) {
    HostTensor slots = sentinel_tensor(DType::kI32, {2, 1, std::max(k, 1)});
    const TopkParams p = c.topk_params(logits, slots, k);
    EXPECT_TRUE(throws_error([&] { cpu::topk(p); }, "topk", "k", std::to_string(k)));
    EXPECT_TRUE(is_sentinel(slots));
  }
  HostTensor narrow = sentinel_tensor(DType::kI32, {2, 1, 3});  // k 4 columns wanted
  EXPECT_TRUE(throws_error([&] { cpu::topk(c.topk_params(logits, narrow, 4)); }, "topk", "slots", "[2, 1, 3]"));
  EXPECT_TRUE(is_sentinel(narrow));
  // A NaN among the visible logits.
  HostTensor slots = sentinel_tensor(DType::kI32, {2, 1, 4});
  logits.data<float>()[12 + 2] = std::numeric_limits<float>::quiet_NaN();
  const TopkParams p = c.topk_params(logits, slots, 4);
  EXPECT_TRUE(throws_error([&] { cpu::topk(p); }, "topk", "logits[1][0][2]", "nan"));
  EXPECT_TRUE(is_sentinel(slots));
}

// An indexer call over DecodeCase's two requests: 4 heads, 12 logits columns of sentinels.
struct IndexerCase {
  DecodeCase c;
  HostTensor q = random_fp8(c.rng, {2, 1, 4, kIndexerDim});
  HostTensor w = random_f32(c.rng, {2, 1, 4}, -1, 1);
  HostTensor logits = sentinel_tensor(DType::kF32, {2, 1, 12});
  IndexerLogitsParams params() {
    IndexerLogitsParams p;
    p.q = q.view();
    p.weights = w.view();
    p.cache = c.f.indexer();
    p.block_table = c.f.block_table_view();
    p.seq_lens = c.f.seq_lens_view();
    p.logits = logits.view();
    return p;
  }
};

// Logits of more than kMaxLogitsColumns (2^30) columns are refused by the indexer and the top-k
// before anything is read (the GPU kernels count columns and their grid-strided positions in int32).
// The views only describe such rows; nothing is allocated for them.
TEST(BadInput, LogitsColumnsPastTheLimit) {
  IndexerCase t;
  float stand_in = 0.0f;
  const TensorView huge =
      TensorView::contiguous(&stand_in, DType::kF32, {2, 1, kMaxLogitsColumns + 1}, Device::cpu());
  IndexerLogitsParams p = t.params();
  p.logits = huge;
  EXPECT_TRUE(throws_error([&] { cpu::indexer_logits(p); }, "indexer_logits", "logits", ""));
  EXPECT_NE(error_of([&] { cpu::indexer_logits(p); }).find("max_len <= 2^30 columns"), std::string::npos);
  HostTensor slots = sentinel_tensor(DType::kI32, {2, 1, 4});
  TopkParams tp = t.c.topk_params(t.logits, slots, 4);
  tp.logits = huge;
  EXPECT_TRUE(throws_error([&] { cpu::topk(tp); }, "topk", "logits", ""));
  EXPECT_TRUE(is_sentinel(slots));
}

TEST(BadInput, IndexerWeightsAndQuery) {
  IndexerCase t;
  IndexerLogitsParams p = t.params();
  t.w.data<float>()[6] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(throws_error([&] { cpu::indexer_logits(p); }, "indexer_logits", "weights element 6", "inf"));
  t.w.data<float>()[6] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(throws_error([&] { cpu::indexer_logits(p); }, "indexer_logits", "weights element 6", "nan"));
  t.w.data<float>()[6] = 0.5f;
  t.q.data<std::uint8_t>()[200] = 0xFF;
  EXPECT_TRUE(throws_error([&] { cpu::indexer_logits(p); }, "indexer_logits", "q element 200", "nan"));
  EXPECT_TRUE(is_sentinel(t.logits));
  t.q.data<std::uint8_t>()[200] = 0;
  HostTensor narrow = sentinel_tensor(DType::kF32, {2, 1, 8});  // request 0 has 9 tokens
  p.logits = narrow.view();
  EXPECT_TRUE(throws_error([&] { cpu::indexer_logits(p); }, "indexer_logits", "seq_lens[0]", "9"));
  EXPECT_TRUE(is_sentinel(narrow));

  HostTensor w3 = random_f32(t.c.rng, {2, 1, 3}, -1, 1);  // q has 4 indexer heads
  p.logits = t.logits.view();
  p.weights = w3.view();
  EXPECT_TRUE(throws_error([&] { cpu::indexer_logits(p); }, "indexer_logits", "weights", "[2, 1, 3]"));
  p.weights = t.w.view();
  HostTensor q2 = random_fp8(t.c.rng, {2, 2, 4, kIndexerDim});  // q_len 2; the logits have rows of q_len 1
  HostTensor w2 = random_f32(t.c.rng, {2, 2, 4}, -1, 1);
  p.q = q2.view();
  p.weights = w2.view();
  EXPECT_TRUE(throws_error([&] { cpu::indexer_logits(p); }, "indexer_logits", "logits", "[2, 1, 12]"));
  EXPECT_TRUE(is_sentinel(t.logits));

  HostTensor q65 = random_fp8(t.c.rng, {2, 1, 65, kIndexerDim});
  HostTensor w65 = random_f32(t.c.rng, {2, 1, 65}, -1, 1);
  p.q = q65.view();
  p.weights = w65.view();
  p.logits = t.logits.view();
  EXPECT_TRUE(throws_error([&] { cpu::indexer_logits(p); }, "indexer_logits", "indexer heads", "65"));
}

// An empty tensor needs no memory (PyTorch gives one a null data pointer): a prefill of no new
// tokens takes q, o and lse of no rows, and still checks its offsets.
TEST(BadInput, EmptyViewsNeedNoMemory) {
  DecodeCase c;
  HostTensor q(DType::kBF16, {0, 4, kQkDim}), o(DType::kBF16, {0, 4, kLatentDim}), lse(DType::kF32, {0, 4});
  ASSERT_EQ(q.view().data, nullptr);
  std::vector<std::int32_t> cu = {0, 0, 0};
  EXPECT_EQ(error_of([&] { cpu::mla_prefill(c.prefill_params(q, cu, o, lse)); }), "");
  cu = {1, 0, 0};
  EXPECT_TRUE(throws_error([&] { cpu::mla_prefill(c.prefill_params(q, cu, o, lse)); }, "mla_prefill", "cu_new_tokens[0]", "1"));
  MlaPrefillParams none = c.prefill_params(q, cu, o, lse);
  none.cu_new_tokens = TensorView::contiguous(nullptr, DType::kI32, {0});  // empty, but B + 1 >= 1 offsets needed
  EXPECT_TRUE(throws_error([&] { cpu::mla_prefill(none); }, "mla_prefill", "cu_new_tokens", "i32 [0]"));
  MlaDecodeParams p = c.params();
  p.q = TensorView::contiguous(nullptr, DType::kBF16, {2, 1, 4, kQkDim});  // elements, no memory: absent
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(p); }, "mla_decode", "q", "absent"));
}

// The value faults a GPU op records (a non-finite q, a NaN query code, a non-finite weight, a NaN
// logit a row sees) throw the reference's own Error for the same input.
TEST(BadInput, DeviceValueFaultsThrowTheReferencesErrors) {
  using Op = DeviceFaultOp;
  using Code = DeviceFaultCode;
  DecodeCase c;
  const std::int64_t element = 1 * kQkDim + 571;  // row 1, a rope dim
  c.q.data<std::uint16_t>()[element] = kBf16Nan | 0x8000u;
  EXPECT_EQ(record_error(record(Op::kMlaDecode, Code::kQuery, {.index = element, .value = kBf16Nan | 0x8000u})),
            error_of([&] { cpu::mla_decode(c.params()); }));
  c.q.data<std::uint16_t>()[element] = kBf16Inf;
  EXPECT_EQ(record_error(record(Op::kMlaDecode, Code::kQuery, {.index = element, .value = kBf16Inf})),
            error_of([&] { cpu::mla_decode(c.params()); }));

  IndexerCase t;
  for (const std::uint8_t code : {std::uint8_t{0x7F}, std::uint8_t{0xFF}}) {
    t.q.data<std::uint8_t>()[300] = code;
    EXPECT_EQ(record_error(record(Op::kIndexerLogits, Code::kIndexerQuery, {.index = 300, .value = code})),
              error_of([&] { cpu::indexer_logits(t.params()); }));
  }
  t.q.data<std::uint8_t>()[300] = 0;
  for (const float w : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
    t.w.data<float>()[5] = w;
    EXPECT_EQ(record_error(record(Op::kIndexerLogits, Code::kWeight, {.index = 5, .value = std::bit_cast<std::uint32_t>(w)})),
              error_of([&] { cpu::indexer_logits(t.params()); }));
  }

  HostTensor logits = random_f32(c.rng, {2, 2, 12}, -1, 1);  // q_len 2: request 1 (3 tokens) row 1 sees 3
  HostTensor slots = sentinel_tensor(DType::kI32, {2, 2, 4});
  logits.data<float>()[(1 * 2 + 0) * 12 + 2] = std::numeric_limits<float>::quiet_NaN();  // row 0 sees 2: not checked
  logits.data<float>()[(1 * 2 + 1) * 12 + 2] = std::numeric_limits<float>::quiet_NaN();
  const TopkParams tp = c.topk_params(logits, slots, 4);
  EXPECT_EQ(record_error(record(Op::kTopk, Code::kLogit, {.index = 1, .position = 2, .length = 1})),
            error_of([&] { cpu::topk(tp); }));
}

TEST(BadInput, IndexerClearRange) {
  IndexerCase t;
  IndexerLogitsParams p = t.params();
  alignas(16) std::uint8_t scratch[80];
  std::fill(std::begin(scratch), std::end(scratch), std::uint8_t{0xA5});
  p.clear_bytes = 32;
  EXPECT_TRUE(throws_error([&] { cpu::indexer_logits(p); }, "indexer_logits", "clear", "null"));
  p.clear = scratch;
  p.clear_bytes = 24;
  EXPECT_TRUE(throws_error([&] { cpu::indexer_logits(p); }, "indexer_logits", "clear_bytes", "24"));
  p.clear = scratch + 8;
  p.clear_bytes = 32;
  EXPECT_TRUE(throws_error([&] { cpu::indexer_logits(p); }, "indexer_logits", "clear", "address"));
  EXPECT_TRUE(is_sentinel(t.logits));
  EXPECT_TRUE(std::all_of(std::begin(scratch), std::end(scratch), [](std::uint8_t x) { return x == 0xA5; }));

  p.clear = scratch + 16;  // a valid range: cleared, and nothing around it
  cpu::indexer_logits(p);
  for (int i = 0; i < 80; ++i) EXPECT_EQ(scratch[i], i >= 16 && i < 48 ? 0 : 0xA5) << "byte " << i;
}

// A view's descriptor is checked before anything reads its data or counts its elements: a count
// that wraps past 2^64 must not pass null data as an empty view, nor a rank past the shape array.
TEST(BadInput, ViewDescriptorsThatCannotBeRead) {
  DecodeCase c;
  const std::int64_t huge = std::int64_t{1} << 58;
  SparseMlaPrefillParams s;
  s.q = TensorView::contiguous(nullptr, DType::kBF16, {huge, 64, kQkDim});  // 2^70 elements
  s.cache = c.f.cache();
  s.indices = TensorView::contiguous(nullptr, DType::kI32, {huge, 64});
  s.o = TensorView::contiguous(nullptr, DType::kBF16, {huge, 64, kLatentDim});
  s.lse = TensorView::contiguous(nullptr, DType::kF32, {huge, 64});
  s.softmax_scale = 0.0625f;
  EXPECT_TRUE(throws_error([&] { cpu::sparse_mla_prefill(s); }, "sparse_mla_prefill", "q", std::to_string(huge)));

  MlaDecodeParams p = c.params();
  p.q.rank = 7;
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(p); }, "mla_decode", "q", "rank 7"));
  p = c.params();
  p.o.shape[3] = -kLatentDim;
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(p); }, "mla_decode", "o", std::to_string(-kLatentDim)));
  p.o.shape[3] = -1;
  try {
    cpu::mla_decode(p);
    ADD_FAILURE() << "an extent of -1 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.expected(), "extents >= 0") << e.what();
  }
  float stand_in = 0.0f;
  EXPECT_TRUE(throws_error([&] { TensorView::contiguous(&stand_in, DType::kBF16, {1, 1, 1, 1, 1}); }, "TensorView",
                           "shape", "5 dims"));
  p = c.params();
  p.lse.dtype = static_cast<DType>(200);  // no DType: its bytes cannot be counted
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(p); }, "mla_decode", "lse", "dtype 200"));
  EXPECT_TRUE(c.outputs_untouched());
}

// Counts and strides of a shape past 2^63 saturate rather than wrap (a count wrapped to 0 would pass
// null data as an empty view), and a view with a zero extent still has its other extents checked:
// [0, 2^62, 576] is refused as the descriptor it is, not read as an empty tensor.
TEST(BadInput, ViewCountsPast64Bits) {
  const std::int64_t big = std::int64_t{1} << 62;
  const TensorView v = TensorView::contiguous(nullptr, DType::kBF16, {big, 4, 4});
  EXPECT_EQ(v.numel(), std::numeric_limits<std::int64_t>::max());
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(TensorView::contiguous(nullptr, DType::kBF16, {big, big, 0}).numel(), 0);
  // A shape known at run time (a span) makes the same view as the braced one; past 4 dims, an Error.
  const std::vector<std::int64_t> sizes = {big, 4, 4};
  const TensorView from_span = TensorView::contiguous(nullptr, DType::kBF16, std::span<const std::int64_t>(sizes));
  EXPECT_EQ(from_span.rank, v.rank);
  EXPECT_EQ(from_span.shape, v.shape);
  EXPECT_EQ(from_span.strides, v.strides);
  const std::vector<std::int64_t> five = {1, 2, 3, 4, 5};
  EXPECT_TRUE(throws_error([&] { TensorView::contiguous(nullptr, DType::kBF16, std::span<const std::int64_t>(five)); },
                           "TensorView", "shape", "5 dims"));

  DecodeCase c;
  HostTensor q(DType::kBF16, {0, 4, kQkDim}), o(DType::kBF16, {0, 4, kLatentDim}), lse(DType::kF32, {0, 4});
  std::vector<std::int32_t> cu = {0, 0, 0};
  MlaPrefillParams p = c.prefill_params(q, cu, o, lse);
  p.q = TensorView::contiguous(nullptr, DType::kBF16, {0, big, kQkDim});
  EXPECT_TRUE(throws_error([&] { cpu::mla_prefill(p); }, "mla_prefill", "q", "[0, " + std::to_string(big) + ", 576]"));
}

// The cache descriptor: slots must fit int32 however num_pages * page_size would wrap, and its dtype
// must be one the layouts define; the append's scale mode likewise.
TEST(BadInput, CacheDescriptorsOutOfRange) {
  DecodeCase c;
  MlaDecodeParams p = c.params();
  p.cache.num_pages = std::int64_t{1} << 61;  // x 4 tokens: 2^63 slots, negative as int64
  EXPECT_TRUE(
      throws_error([&] { cpu::mla_decode(p); }, "mla_decode", "cache.num_pages", std::to_string(p.cache.num_pages)));
  p.cache = c.f.cache();
  p.cache.num_pages = (std::int64_t{1} << 29) + 1;  // 2^31 + 4 slots
  EXPECT_TRUE(
      throws_error([&] { cpu::mla_decode(p); }, "mla_decode", "cache.num_pages", std::to_string(p.cache.num_pages)));
  p.cache = c.f.cache();
  p.cache.dtype = static_cast<KvDtype>(7);
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(p); }, "mla_decode", "cache.dtype", "7"));
  p.cache = c.f.cache();
  p.cache.page_size = 0;
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(p); }, "mla_decode", "cache.page_size", "0"));
  p.cache = c.f.cache();
  p.cache.num_pages = 0;
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(p); }, "mla_decode", "cache.num_pages", "0"));
  IndexerCase t;
  IndexerLogitsParams ip = t.params();
  ip.cache.page_size = 0;
  EXPECT_TRUE(throws_error([&] { cpu::indexer_logits(ip); }, "indexer_logits", "cache.page_size", "0"));
  EXPECT_TRUE(c.outputs_untouched() && is_sentinel(t.logits));

  // The largest pool: num_pages * page_size = 2^31 - 1 slots at most. The descriptor is checked
  // alone, at an address far from this process's memory (its 1.4 TB would overlap the others).
  p = c.params();
  p.cache.page_size = 4;
  p.cache.num_pages = INT32_MAX / 4;
  p.cache.data = reinterpret_cast<std::uint8_t*>(std::uintptr_t{0xFFFF} << 48);
  using detail::Outputs;
  EXPECT_NO_THROW(detail::validate_shapes(p, Device::cpu(), Outputs::kReferenceTypes));
  p.cache.num_pages += 1;
  EXPECT_TRUE(throws_error([&] { detail::validate_shapes(p, Device::cpu(), Outputs::kReferenceTypes); }, "mla_decode",
                           "cache.num_pages", std::to_string(p.cache.num_pages)));

  AppendCase a;
  AppendParams ap = a.params();
  ap.cache.dtype = static_cast<KvDtype>(7);
  EXPECT_TRUE(throws_error([&] { cpu::append(ap); }, "append", "cache.dtype", "7"));
  ap = a.params();
  ap.scale_mode = static_cast<ScaleMode>(9);
  EXPECT_TRUE(throws_error([&] { cpu::append(ap); }, "append", "scale_mode", "9"));
  EXPECT_TRUE(a.unchanged());
}

// CUDA views must be on the device the call runs on, index included (the reference runs on the CPU;
// the shape check is what the CUDA backend calls with its current device).
TEST(BadInput, ViewsOnAnotherDevice) {
  DecodeCase c;
  MlaDecodeParams p = c.params();
  const auto on = [](TensorView v, Device d) {
    v.device = d;
    return v;
  };
  p.q = on(p.q, Device::cuda(1));
  p.cache.device = Device::cuda(0);
  p.block_table = on(p.block_table, Device::cuda(0));
  p.seq_lens = on(p.seq_lens, Device::cuda(0));
  p.o = on(p.o, Device::cuda(0));
  p.lse = on(p.lse, Device::cuda(0));
  using detail::Outputs;
  EXPECT_TRUE(throws_error([&] { detail::validate_shapes(p, Device::cuda(0), Outputs::kDeviceTypes); }, "mla_decode",
                           "q", "cuda:1"));
  p.q = on(p.q, Device::cuda(0));
  EXPECT_NO_THROW(detail::validate_shapes(p, Device::cuda(0), Outputs::kReferenceTypes));
  p.cache.device = Device::cuda(2);
  EXPECT_TRUE(throws_error([&] { detail::validate_shapes(p, Device::cuda(0), Outputs::kReferenceTypes); }, "mla_decode",
                           "cache.device", "cuda:2"));
  // A kind the enum does not define is named as a number, not taken for CUDA.
  p.cache.device = Device::cuda(0);
  p.q.device.kind = static_cast<DeviceKind>(7);
  EXPECT_TRUE(throws_error([&] { detail::validate_shapes(p, Device::cuda(0), Outputs::kReferenceTypes); }, "mla_decode",
                           "q", "device kind 7 (not cpu or cuda)"));
}

// A split count outside 0 .. kMaxSplits, which a GPU call refuses, is refused by the reference too
// (which needs none), so that the CPU catches it; 0 and 1024 pass.
TEST(BadInput, SplitCountsOutsideWhatAGpuTakes) {
  DecodeCase c;
  MlaDecodeParams p = c.params();
  for (const int bad : {-3, kMaxSplits + 1}) {
    p.num_splits = bad;
    EXPECT_TRUE(throws_error([&] { cpu::mla_decode(p); }, "mla_decode", "num_splits", std::to_string(bad)));
    EXPECT_TRUE(c.outputs_untouched());
  }
  for (const int good : {0, kMaxSplits}) {
    p.num_splits = good;
    EXPECT_NO_THROW(cpu::mla_decode(p)) << good;
  }
}

// A block table whose capacity (max_pages x page_size) passes 2^30 tokens is refused by its shape,
// before any of its entries is read (the view claims more rows than its memory holds).
// (ReferenceScratchBeyondHostMemoryIsNamed below takes a table of exactly 2^30.)
TEST(BadInput, BlockTableCapacityBeyond2To30) {
  DecodeCase c;
  MlaDecodeParams p = c.params();
  for (const std::int64_t pages : {(std::int64_t{1} << 28) + 1, std::int64_t{1} << 30}) {  // x 4 tokens
    p.block_table = TensorView::contiguous(c.table.data(), DType::kI32, {2, pages});
    EXPECT_TRUE(throws_error([&] { cpu::mla_decode(p); }, "mla_decode", "block_table", std::to_string(pages)));
    EXPECT_NE(error_of([&] { cpu::mla_decode(p); }).find("max_pages * page_size <= 2^30 (page_size 4)"),
              std::string::npos);
    EXPECT_TRUE(c.outputs_untouched());
  }
}

// Whether this build runs under AddressSanitizer (LKV_SANITIZE) or ThreadSanitizer, whose allocators
// end the process on an allocation that the cap below refuses.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitizerAllocator = true;  // GCC; clang below
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitizerAllocator = true;
#else
constexpr bool kSanitizerAllocator = false;
#endif
#else
constexpr bool kSanitizerAllocator = false;
#endif

// Caps this process's address space a little above what it holds now, for the life of the object:
// an allocation far beyond that then fails whatever the machine's overcommit policy.
class AddressSpaceCap {
 public:
  AddressSpaceCap() {
    getrlimit(RLIMIT_AS, &saved_);
    long pages = 0;
    if (FILE* statm = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(statm, "%ld", &pages) != 1) pages = 0;
      std::fclose(statm);
    }
    const auto now = static_cast<rlim_t>(pages) * static_cast<rlim_t>(sysconf(_SC_PAGESIZE));
    rlimit cap = saved_;
    cap.rlim_cur = std::min<rlim_t>(saved_.rlim_cur, now + (rlim_t{1} << 31));  // 2 GiB to spare
    active_ = pages > 0 && setrlimit(RLIMIT_AS, &cap) == 0;
  }
  ~AddressSpaceCap() { setrlimit(RLIMIT_AS, &saved_); }
  bool active() const { return active_; }

 private:
  rlimit saved_{};
  bool active_ = false;
};

// The reference holds a request's dequantized tokens at once (2.3 KB a token in MLA, 1.2 KB in the
// indexer). A length within the block table's capacity whose scratch the host cannot allocate is
// named as that length before any output is written, not a std::bad_alloc after the requests before it.
TEST(BadInput, ReferenceScratchBeyondHostMemoryIsNamed) {
  if (kSanitizerAllocator) GTEST_SKIP() << "a sanitizer's allocator ends the process on an allocation the cap refuses";
  PagedFixtureOptions options;
  options.page_size = 4096;
  options.lengths = {4, 3};
  Rng rng = test_rng();
  PagedFixture f = make_paged_fixture(options, rng);
  constexpr std::int64_t kColumns = std::int64_t{1} << 18;  // x 4096 tokens: capacity 2^30, the largest
  std::vector<std::int32_t> table(2 * kColumns, f.block_table[0]);
  std::vector<std::int32_t> lens = {4, static_cast<std::int32_t>(kColumns * 4096)};
  HostTensor q = random_bf16(rng, {2, 1, 4, kQkDim});
  HostTensor o = sentinel_tensor(DType::kBF16, {2, 1, 4, kLatentDim}), lse = sentinel_tensor(DType::kF32, {2, 1, 4});
  MlaDecodeParams p;
  p.q = q.view();
  p.cache = f.cache();
  p.block_table = TensorView::contiguous(table.data(), DType::kI32, {2, kColumns});
  p.seq_lens = TensorView::contiguous(lens.data(), DType::kI32, {2});
  p.o = o.view();
  p.lse = lse.view();
  p.softmax_scale = 0.0625f;

  HostTensor q_idx = random_fp8(rng, {2, 4, kIndexerDim});
  HostTensor w = random_f32(rng, {2, 4}, -1, 1);
  HostTensor rows = sentinel_tensor(DType::kI32, {2, 8});
  std::vector<std::int32_t> cu = {0, 1, 2};
  const IndexerPrefillParams xp = indexer_prefill_params(q_idx, w, cu, f.indexer(), p.block_table, p.seq_lens, rows);

  const AddressSpaceCap cap;
  ASSERT_TRUE(cap.active()) << "could not cap the address space";
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(p); }, "mla_decode", "seq_lens[1]", "1073741824"));
  EXPECT_TRUE(is_sentinel(o) && is_sentinel(lse));
  EXPECT_TRUE(throws_error([&] { cpu::indexer_prefill(xp); }, "indexer_prefill", "seq_lens[1]", "1073741824"));
  EXPECT_TRUE(is_sentinel(rows));
  EXPECT_NE(error_of([&] { cpu::mla_decode(p); }).find("could not be allocated"), std::string::npos);
}

// A prefill's negative length is named as the length, not as the new-token offsets it also breaks.
TEST(BadInput, PrefillNegativeLengthIsNamed) {
  DecodeCase c;
  HostTensor q(DType::kBF16, {0, 4, kQkDim}), o(DType::kBF16, {0, 4, kLatentDim}), lse(DType::kF32, {0, 4});
  std::vector<std::int32_t> cu = {0, 0, 0};
  MlaPrefillParams p = c.prefill_params(q, cu, o, lse);
  std::vector<std::int32_t> lens = {-5, 3};
  p.seq_lens = TensorView::contiguous(lens.data(), DType::kI32, {2});
  EXPECT_TRUE(throws_error([&] { cpu::mla_prefill(p); }, "mla_prefill", "seq_lens[0]", "-5"));
}

// Through the registry: a call a backend's shape limits refuse says which limit.
TEST(BadInput, RunNamesTheIndexerHeadLimit) {
  IndexerCase t;
  HostTensor q = random_fp8(t.c.rng, {2, 1, 200, kIndexerDim});
  HostTensor w = random_f32(t.c.rng, {2, 1, 200}, -1, 1);
  IndexerLogitsParams p = t.params();
  p.q = q.view();
  p.weights = w.view();
  const Backend* reference = find_backend("reference");
  ASSERT_NE(reference, nullptr);
  EXPECT_EQ(error_of([&] { run(*reference, p, {}, DeviceInfo{}); }),
            "indexer_logits: backend 'reference' cannot run this call: indexer heads 200 outside 1 .. 64");
  EXPECT_TRUE(is_sentinel(t.logits));
}

// Through the registry: an extent past int32 is named as the caller's view, not read truncated
// by the backend's selection (heads 2^32 + 200 as "heads 200 outside 1 .. 128").
TEST(BadInput, RunNamesAnExtentPastInt32) {
  DecodeCase c;
  MlaDecodeParams p = c.params();
  const std::int64_t heads = (std::int64_t{1} << 32) + 200;
  p.q = TensorView::contiguous(p.q.data, DType::kBF16, {2, 1, heads, kQkDim});
  const Backend* reference = find_backend("reference");
  ASSERT_NE(reference, nullptr);
  EXPECT_TRUE(throws_error([&] { run(*reference, p, {}, DeviceInfo{}); }, "mla_decode", "q", std::to_string(heads)));
  EXPECT_TRUE(c.outputs_untouched());
}

// A call that names no device runs where its tensors are: on host tensors, the reference runs on
// the CPU (also on a machine with a GPU, where the CPU tests run in scripts/gpu_run.sh), and a
// backend that runs only on a GPU refuses them as a call on the CPU, saying which memory chose it
// (a call that names the CPU is refused without those words), writing nothing.
TEST(BadInput, RunWithoutADeviceSelectsForTheTensorsDevice) {
  DecodeCase c, named;  // the same inputs (one seed)
  const MlaDecodeParams p = c.params();
  const GpuOnly gpu_only;
  EXPECT_EQ(error_of([&] { run(gpu_only, p); }),
            "mla_decode: backend 'gpu_only' cannot run this call: needs a GPU (device is cpu); a call that names no "
            "device runs where its cache.device is (cpu)");
  EXPECT_EQ(error_of([&] { run(gpu_only, p, {}, DeviceInfo{}); }),
            "mla_decode: backend 'gpu_only' cannot run this call: needs a GPU (device is cpu)");
  HostTensor logits = random_f32(c.rng, {2, 1, 12}, -1, 1), slots = sentinel_tensor(DType::kI32, {2, 1, 4});
  EXPECT_EQ(error_of([&] { run(gpu_only, c.topk_params(logits, slots, 4)); }),
            "topk: backend 'gpu_only' cannot run this call: needs a GPU (device is cpu); a call that names no device "
            "runs where its logits.device is (cpu)");
  EXPECT_TRUE(c.outputs_untouched());
  EXPECT_TRUE(is_sentinel(slots));
  const Backend* reference = find_backend("reference");
  ASSERT_NE(reference, nullptr);
  ASSERT_EQ(error_of([&] { run(*reference, p); }), "");
  run(*reference, named.params(), {}, DeviceInfo{});
  EXPECT_FALSE(c.outputs_untouched());
  EXPECT_EQ(std::memcmp(c.o.raw(), named.o.raw(), c.o.bytes()), 0);
  EXPECT_EQ(std::memcmp(c.lse.raw(), named.lse.raw(), c.lse.bytes()), 0);
}

TEST(BadInput, ShardModelNeedsADivisorOfTheHeads) {
  const ModelPreset& glm5 = model_preset("glm5");
  EXPECT_EQ(shard_model(glm5, 8).heads_per_gpu, 8);
  EXPECT_EQ(shard_model(model_preset("deepseek-v3.2"), 128).heads_per_gpu, 1);
  EXPECT_TRUE(throws_error([&] { shard_model(glm5, 3); }, "model", "tp", "3"));
  EXPECT_TRUE(throws_error([&] { shard_model(glm5, 0); }, "model", "tp", "0"));
  EXPECT_TRUE(throws_error([&] { shard_model(glm5, 128); }, "model", "tp", "128"));
  EXPECT_TRUE(throws_error([&] { model_preset("llama"); }, "model", "model", "llama"));
}

TEST(BadInput, DequantizeSlotOutsideThePool) {
  DecodeCase c;
  double out[kQkDim];
  EXPECT_TRUE(throws_error([&] { cpu::dequantize_token(c.f.cache(), c.f.num_pages() * c.f.page_size, out); },
                           "dequantize_token", "slot", std::to_string(c.f.num_pages() * c.f.page_size)));
  double key[kIndexerDim], scale;
  EXPECT_TRUE(throws_error([&] { cpu::dequantize_indexer_key(c.f.indexer(), -1, key, &scale); },
                           "dequantize_indexer_key", "slot", "-1"));
}


// ---- sparse_mla_decode -----------------------------------------------------------------------

// Index rows [2, q_len, width] for DecodeCase's two requests: each row's first entry is a slot its
// request holds, the rest -1.
HostTensor valid_indices(DecodeCase& c, std::int64_t q_len = 1, std::int64_t width = 3) {
  HostTensor idx(DType::kI32, {2, q_len, width});
  std::fill_n(idx.data<std::int32_t>(), idx.numel(), -1);
  for (std::int64_t b = 0; b < 2; ++b) {
    for (std::int64_t i = 0; i < q_len; ++i) idx.data<std::int32_t>()[(b * q_len + i) * width] = static_cast<std::int32_t>(c.f.slot(b, 0));
  }
  return idx;
}

TEST(BadInput, SparseDecodeNanOrInfQuery) {
  DecodeCase c;
  HostTensor idx = valid_indices(c);
  const SparseMlaDecodeParams p = c.sparse_params(idx);
  EXPECT_NO_THROW(cpu::sparse_mla_decode(p));  // the case itself is valid
  fill_sentinel(c.o);
  fill_sentinel(c.lse);

  c.q.data<std::uint16_t>()[777] = kBf16Nan;
  EXPECT_TRUE(throws_error([&] { cpu::sparse_mla_decode(p); }, "sparse_mla_decode", "q element 777", "nan"));
  EXPECT_TRUE(c.outputs_untouched());
  c.q.data<std::uint16_t>()[777] = 0;
  const std::int64_t element = 5 * kQkDim + 570;  // request 1, a rope dim
  c.q.data<std::uint16_t>()[element] = kBf16Inf;
  EXPECT_TRUE(throws_error([&] { cpu::sparse_mla_decode(p); }, "sparse_mla_decode", "q element " + std::to_string(element), "inf"));
  EXPECT_TRUE(c.outputs_untouched());
  c.q.data<std::uint16_t>()[element] = 0xFF80;  // -inf
  EXPECT_TRUE(throws_error([&] { cpu::sparse_mla_decode(p); }, "sparse_mla_decode", "q element " + std::to_string(element), "inf"));
  EXPECT_TRUE(c.outputs_untouched());
}

TEST(BadInput, SparseDecodeTooManyHeads) {
  DecodeCase ok(128);
  HostTensor ok_idx = valid_indices(ok);
  EXPECT_NO_THROW(cpu::sparse_mla_decode(ok.sparse_params(ok_idx)));  // 128 heads: the limit

  DecodeCase c(129);
  HostTensor idx = valid_indices(c);
  EXPECT_TRUE(throws_error([&] { cpu::sparse_mla_decode(c.sparse_params(idx)); }, "sparse_mla_decode", "heads", "129"));
  EXPECT_TRUE(c.outputs_untouched());
}

TEST(BadInput, SparseDecodeQueryLongerThanFour) {
  DecodeCase c;
  for (const std::int64_t q_len : {4, 5}) {  // 4 is the limit; q, indices, o and lse all agree
    HostTensor q = random_bf16(c.rng, {2, q_len, 4, kQkDim});
    HostTensor o = sentinel_tensor(DType::kBF16, {2, q_len, 4, kLatentDim});
    HostTensor lse = sentinel_tensor(DType::kF32, {2, q_len, 4});
    HostTensor idx = valid_indices(c, q_len);
    SparseMlaDecodeParams p = c.sparse_params(idx);
    p.q = q.view();
    p.o = o.view();
    p.lse = lse.view();
    if (q_len == 4) {
      EXPECT_NO_THROW(cpu::sparse_mla_decode(p));
      continue;
    }
    EXPECT_TRUE(throws_error([&] { cpu::sparse_mla_decode(p); }, "sparse_mla_decode", "q_len", "5"));
    EXPECT_TRUE(is_sentinel(o) && is_sentinel(lse));
  }
}

TEST(BadInput, SparseDecodeMoreThan2048IndexColumns) {
  DecodeCase c;
  HostTensor ok_idx = valid_indices(c, 1, 2048);
  EXPECT_NO_THROW(cpu::sparse_mla_decode(c.sparse_params(ok_idx)));  // 2048: the limit
  fill_sentinel(c.o);
  fill_sentinel(c.lse);

  HostTensor idx = valid_indices(c, 1, 2049);
  EXPECT_TRUE(throws_error([&] { cpu::sparse_mla_decode(c.sparse_params(idx)); }, "sparse_mla_decode",
                           "indices.shape[2]", "2049"));
  HostTensor none(DType::kI32, {2, 1, 0});
  EXPECT_TRUE(throws_error([&] { cpu::sparse_mla_decode(c.sparse_params(none)); }, "sparse_mla_decode",
                           "indices.shape[2] (topk)", "0"));
  EXPECT_TRUE(c.outputs_untouched());

  HostTensor q = random_bf16(c.rng, {2, 4, kQkDim});  // the prefill's rows: the same limit
  HostTensor o = sentinel_tensor(DType::kBF16, {2, 4, kLatentDim}), lse = sentinel_tensor(DType::kF32, {2, 4});
  for (const std::int64_t width : {2048, 2049}) {
    HostTensor rows(DType::kI32, {2, width});
    std::fill_n(rows.data<std::int32_t>(), rows.numel(), -1);
    const SparseMlaPrefillParams p = c.sparse_prefill_params(q, rows, o, lse);
    if (width == 2048) {
      EXPECT_NO_THROW(cpu::sparse_mla_prefill(p));
      fill_sentinel(o);
      fill_sentinel(lse);
      continue;
    }
    EXPECT_TRUE(
        throws_error([&] { cpu::sparse_mla_prefill(p); }, "sparse_mla_prefill", "indices.shape[1] (topk)", "2049"));
    EXPECT_TRUE(is_sentinel(o) && is_sentinel(lse));
  }
}

// softmax_scale must be a finite number above 0; the value is named as given.
TEST(BadInput, SparseDecodeScaleNotPositiveAndFinite) {
  DecodeCase c;
  HostTensor idx = valid_indices(c);
  const std::pair<float, const char*> bad[] = {
      {0.0f, "0"}, {-0.5f, "-0.5"}, {std::numeric_limits<float>::infinity(), "inf"}};
  for (const auto& [scale, text] : bad) {
    SparseMlaDecodeParams p = c.sparse_params(idx);
    p.softmax_scale = scale;
    EXPECT_TRUE(throws_error([&] { cpu::sparse_mla_decode(p); }, "sparse_mla_decode", "softmax_scale", text));
    EXPECT_TRUE(c.outputs_untouched());
  }
}

// ---- mla_prefill ------------------------------------------------------------------------------

// A prefill over DecodeCase's fixture: request 0's last 4 tokens are new (q, o and lse of 4 rows
// and 4 heads, sentinel outputs), over the case's own copy of the block table and lengths.
struct PrefillCase {
  DecodeCase c;
  HostTensor q = random_bf16(c.rng, {4, 4, kQkDim});
  HostTensor o = sentinel_tensor(DType::kBF16, {4, 4, kLatentDim});
  HostTensor lse = sentinel_tensor(DType::kF32, {4, 4});
  std::vector<std::int32_t> cu = {0, 4, 4};
  MlaPrefillParams params() {
    MlaPrefillParams p = c.prefill_params(q, cu, o, lse);
    p.block_table = TensorView::contiguous(c.table.data(), DType::kI32, {2, c.f.max_pages});
    p.seq_lens = TensorView::contiguous(c.lens.data(), DType::kI32, {2});
    return p;
  }
  bool outputs_untouched() const { return is_sentinel(o) && is_sentinel(lse); }
};

TEST(BadInput, PrefillBlockTableOutsideThePool) {
  PrefillCase t;
  EXPECT_NO_THROW(cpu::mla_prefill(t.params()));  // the case itself is valid
  fill_sentinel(t.o);
  fill_sentinel(t.lse);

  const std::int64_t num_pages = t.c.f.num_pages();
  t.c.table[2] = static_cast<std::int32_t>(num_pages);  // request 0's third page (it has 9 tokens)
  EXPECT_TRUE(throws_error([&] { cpu::mla_prefill(t.params()); }, "mla_prefill", "block_table[0][2]", std::to_string(num_pages)));
  EXPECT_TRUE(t.outputs_untouched());
  t.c.table[2] = -1;
  EXPECT_TRUE(throws_error([&] { cpu::mla_prefill(t.params()); }, "mla_prefill", "block_table[0][2]", "-1"));
  EXPECT_TRUE(t.outputs_untouched());
}

TEST(BadInput, PrefillLengthBeyondCapacity) {
  PrefillCase t;
  const std::int64_t capacity = static_cast<std::int64_t>(t.c.f.max_pages) * t.c.f.page_size;
  t.c.lens[1] = static_cast<std::int32_t>(capacity + 1);
  EXPECT_TRUE(throws_error([&] { cpu::mla_prefill(t.params()); }, "mla_prefill", "seq_lens[1]", std::to_string(capacity + 1)));
  EXPECT_NE(error_of([&] { cpu::mla_prefill(t.params()); }).find("capacity"), std::string::npos);
  EXPECT_TRUE(t.outputs_untouched());
}

TEST(BadInput, PrefillNanOrInfQuery) {
  PrefillCase t;
  const std::int64_t element = 2 * 4 * kQkDim + 100;  // row 2, head 0
  t.q.data<std::uint16_t>()[element] = kBf16Nan;
  EXPECT_TRUE(throws_error([&] { cpu::mla_prefill(t.params()); }, "mla_prefill", "q element " + std::to_string(element), "nan"));
  EXPECT_TRUE(t.outputs_untouched());
  t.q.data<std::uint16_t>()[element] = kBf16Inf;
  EXPECT_TRUE(throws_error([&] { cpu::mla_prefill(t.params()); }, "mla_prefill", "q element " + std::to_string(element), "inf"));
  EXPECT_TRUE(t.outputs_untouched());
}

TEST(BadInput, PrefillTooManyHeads) {
  PrefillCase t;
  t.q = random_bf16(t.c.rng, {4, 129, kQkDim});
  t.o = sentinel_tensor(DType::kBF16, {4, 129, kLatentDim});
  t.lse = sentinel_tensor(DType::kF32, {4, 129});
  EXPECT_TRUE(throws_error([&] { cpu::mla_prefill(t.params()); }, "mla_prefill", "heads", "129"));
  EXPECT_TRUE(t.outputs_untouched());
}

TEST(BadInput, PrefillOutputsOfTheWrongShape) {
  PrefillCase t;
  t.o = sentinel_tensor(DType::kBF16, {3, 4, kLatentDim});  // one row short of q's 4
  EXPECT_TRUE(throws_error([&] { cpu::mla_prefill(t.params()); }, "mla_prefill", "o", "[3, 4, 512]"));
  EXPECT_TRUE(t.outputs_untouched());

  t.o = sentinel_tensor(DType::kBF16, {4, 4, kLatentDim});
  t.lse = sentinel_tensor(DType::kF32, {4, 5});  // a head too many
  EXPECT_TRUE(throws_error([&] { cpu::mla_prefill(t.params()); }, "mla_prefill", "lse", "[4, 5]"));
  EXPECT_TRUE(t.outputs_untouched());
}

// ---- indexer_logits ---------------------------------------------------------------------------

// IndexerCase's call over its DecodeCase's own copy of the block table and lengths.
IndexerLogitsParams own_paging(IndexerCase& t) {
  IndexerLogitsParams p = t.params();
  p.block_table = TensorView::contiguous(t.c.table.data(), DType::kI32, {2, t.c.f.max_pages});
  p.seq_lens = TensorView::contiguous(t.c.lens.data(), DType::kI32, {2});
  return p;
}

TEST(BadInput, IndexerBlockTableOutsideThePool) {
  IndexerCase t;
  EXPECT_NO_THROW(cpu::indexer_logits(own_paging(t)));  // the case itself is valid
  fill_sentinel(t.logits);

  const std::int64_t num_pages = t.c.f.num_pages();
  t.c.table[2] = static_cast<std::int32_t>(num_pages);  // request 0's third page (it has 9 tokens)
  EXPECT_TRUE(throws_error([&] { cpu::indexer_logits(own_paging(t)); }, "indexer_logits", "block_table[0][2]",
                           std::to_string(num_pages)));
  EXPECT_TRUE(is_sentinel(t.logits));
}

TEST(BadInput, IndexerNegativeLength) {
  IndexerCase t;
  t.c.lens[1] = -1;
  EXPECT_TRUE(throws_error([&] { cpu::indexer_logits(own_paging(t)); }, "indexer_logits", "seq_lens[1]", "-1"));
  EXPECT_TRUE(is_sentinel(t.logits));
}

// Past the block table's capacity, with logits columns enough for it: the capacity is what refuses.
TEST(BadInput, IndexerLengthBeyondCapacity) {
  IndexerCase t;
  const std::int64_t capacity = static_cast<std::int64_t>(t.c.f.max_pages) * t.c.f.page_size;
  t.logits = sentinel_tensor(DType::kF32, {2, 1, capacity + 4});
  t.c.lens[1] = static_cast<std::int32_t>(capacity + 1);
  EXPECT_TRUE(throws_error([&] { cpu::indexer_logits(own_paging(t)); }, "indexer_logits", "seq_lens[1]",
                           std::to_string(capacity + 1)));
  EXPECT_NE(error_of([&] { cpu::indexer_logits(own_paging(t)); }).find("capacity"), std::string::npos);
  EXPECT_TRUE(is_sentinel(t.logits));
}

TEST(BadInput, IndexerQueryLongerThanFour) {
  IndexerCase t;
  t.q = random_fp8(t.c.rng, {2, 5, 4, kIndexerDim});
  t.w = random_f32(t.c.rng, {2, 5, 4}, -1, 1);
  t.logits = sentinel_tensor(DType::kF32, {2, 5, 12});
  EXPECT_TRUE(throws_error([&] { cpu::indexer_logits(t.params()); }, "indexer_logits", "q_len", "5"));
  EXPECT_TRUE(is_sentinel(t.logits));
}

// ---- topk -------------------------------------------------------------------------------------

TEST(BadInput, TopkNegativeLength) {
  DecodeCase c;
  HostTensor logits = random_f32(c.rng, {2, 1, 12}, -1, 1);
  HostTensor slots = sentinel_tensor(DType::kI32, {2, 1, 4});
  TopkParams p = c.topk_params(logits, slots, 4);
  p.seq_lens = TensorView::contiguous(c.lens.data(), DType::kI32, {2});
  EXPECT_NO_THROW(cpu::topk(p));  // the case itself is valid
  fill_sentinel(slots);

  c.lens[0] = -3;
  EXPECT_TRUE(throws_error([&] { cpu::topk(p); }, "topk", "seq_lens[0]", "-3"));
  EXPECT_TRUE(is_sentinel(slots));
}

// The top-k sees no cache: its page size is an argument, and its block-table pages are refused
// where their slots would pass int32 (pages up to INT32_MAX / page_size - 1 pass).
TEST(BadInput, TopkPageSizeAndPages) {
  DecodeCase c;
  HostTensor logits = random_f32(c.rng, {2, 1, 12}, -1, 1);
  HostTensor slots = sentinel_tensor(DType::kI32, {2, 1, 4});
  TopkParams p = c.topk_params(logits, slots, 4);
  p.block_table = TensorView::contiguous(c.table.data(), DType::kI32, {2, c.f.max_pages});
  p.page_size = TopkParams{}.page_size;  // none by default: the caller must say
  EXPECT_EQ(p.page_size, 0);
  EXPECT_TRUE(throws_error([&] { cpu::topk(p); }, "topk", "page_size", "0"));
  EXPECT_NE(error_of([&] { cpu::topk(p); }).find("the caches' page size: set it"), std::string::npos);
  EXPECT_TRUE(is_sentinel(slots));

  p.page_size = c.f.page_size;  // 4
  const std::int32_t last = INT32_MAX / 4 - 1;
  c.table[0] = last + 1;
  EXPECT_TRUE(throws_error([&] { cpu::topk(p); }, "topk", "block_table[0][0]", std::to_string(last + 1)));
  EXPECT_TRUE(is_sentinel(slots));
  c.table[0] = last;  // request 0's first 4 tokens, its largest logits: slots 4 * last .. 4 * last + 3 < 2^31
  for (int t = 0; t < 4; ++t) logits.data<float>()[t] = static_cast<float>(10 - t);
  ASSERT_NO_THROW(cpu::topk(p));
  for (int j = 0; j < 4; ++j) EXPECT_EQ(slots.data<std::int32_t>()[j], 4 * last + j) << "column " << j;
}

TEST(BadInput, TopkQueryLongerThanFour) {
  DecodeCase c;
  HostTensor logits = random_f32(c.rng, {2, 5, 12}, -1, 1);
  HostTensor slots = sentinel_tensor(DType::kI32, {2, 5, 4});
  const TopkParams p = c.topk_params(logits, slots, 4);
  EXPECT_TRUE(throws_error([&] { cpu::topk(p); }, "topk", "q_len", "5"));
  EXPECT_TRUE(is_sentinel(slots));
}

// ---- append -----------------------------------------------------------------------------------

TEST(BadInput, AppendIndexerPagesDiffer) {
  AppendCase c;
  const std::int64_t num_pages = c.f.num_pages();
  for (const std::int64_t pages : {num_pages - 1, num_pages + 1}) {
    AppendParams p = c.params();
    p.indexer.num_pages = pages;
    EXPECT_TRUE(throws_error([&] { cpu::append(p); }, "append", "indexer.num_pages", std::to_string(pages)));
    EXPECT_TRUE(c.unchanged());
  }
}

TEST(BadInput, AppendIndexerKeysWithoutIndexerCache) {
  AppendCase c;
  AppendParams p = c.params();
  p.indexer = IndexerCache{};  // no indexer cache, but keys given: they would be dropped silently
  EXPECT_TRUE(throws_error([&] { cpu::append(p); }, "append", "indexer", "absent"));
  EXPECT_NE(error_of([&] { cpu::append(p); }).find("indexer_keys"), std::string::npos);
  EXPECT_TRUE(c.unchanged());
}

// The CPU reference takes host memory only: a cache or view marked CUDA is refused, not read.
TEST(BadInput, AppendOnAnotherDevice) {
  AppendCase c;
  AppendParams p = c.params();
  p.cache.device = Device::cuda();
  EXPECT_TRUE(throws_error([&] { cpu::append(p); }, "append", "cache.device", "cuda:0"));
  EXPECT_TRUE(c.unchanged());

  p = c.params();
  p.indexer.device = Device::cuda();
  EXPECT_TRUE(throws_error([&] { cpu::append(p); }, "append", "indexer.device", "cuda:0"));
  EXPECT_TRUE(c.unchanged());

  p = c.params();
  p.latent.device = Device::cuda();
  EXPECT_TRUE(throws_error([&] { cpu::append(p); }, "append", "latent", "cuda:0"));
  EXPECT_TRUE(c.unchanged());

  p = c.params();
  p.slots.device = Device::cuda();
  EXPECT_TRUE(throws_error([&] { cpu::append(p); }, "append", "slots", "cuda:0"));
  EXPECT_TRUE(c.unchanged());

  p = c.params();
  p.indexer_keys.device = Device::cuda();
  EXPECT_TRUE(throws_error([&] { cpu::append(p); }, "append", "indexer_keys", "cuda:0"));
  EXPECT_TRUE(c.unchanged());
}

// ---- mla_decode -------------------------------------------------------------------------------

// softmax_scale must be a finite number above 0 (NaN: DecodeTooManyHeadsOrLongQuery).
TEST(BadInput, DecodeScaleNotPositiveAndFinite) {
  DecodeCase c;
  const std::pair<float, const char*> bad[] = {
      {0.0f, "0"}, {-0.5f, "-0.5"}, {std::numeric_limits<float>::infinity(), "inf"}};
  for (const auto& [scale, text] : bad) {
    MlaDecodeParams p = c.params();
    p.softmax_scale = scale;
    EXPECT_TRUE(throws_error([&] { cpu::mla_decode(p); }, "mla_decode", "softmax_scale", text));
    EXPECT_TRUE(c.outputs_untouched());
  }
}

// q must be contiguous: a view of 4 of 8 heads has the right shape but strides of 8 heads.
TEST(BadInput, DecodeStridedQuery) {
  DecodeCase c;
  HostTensor wide = random_bf16(c.rng, {2, 1, 8, kQkDim});
  MlaDecodeParams p = c.params();
  p.q = wide.view();
  p.q.shape[2] = 4;  // strides stay {8 * 576, 8 * 576, 576, 1}
  ASSERT_FALSE(p.q.is_contiguous());
  EXPECT_TRUE(throws_error([&] { cpu::mla_decode(p); }, "mla_decode", "q", "strided"));
  EXPECT_TRUE(c.outputs_untouched());
  // A dim of extent 1 is never stepped over: any stride there is contiguous (PyTorch's rule).
  p = c.params();
  p.q.strides[1] = 12345;
  EXPECT_TRUE(p.q.is_contiguous());
  EXPECT_NO_THROW(cpu::mla_decode(p));
}


// ---- memory shared between arguments ----------------------------------------------------------

// What a call writes shares no byte with anything else it touches; reads may share.
TEST(BadInput, SpansApartOnlyWhereWritten) {
  alignas(16) std::uint8_t bytes[64] = {};
  using detail::MemorySpan;
  const MemorySpan a{"a", bytes, 32, true}, b_read{"b", bytes + 16, 32, false}, c_read{"c", bytes + 8, 8, false};
  EXPECT_TRUE(throws_error([&] { detail::expect_apart("op", {a, b_read}); }, "op", "a", "32 bytes"));
  EXPECT_NE(error_of([&] { detail::expect_apart("op", {b_read, a}); }).find("apart from b"), std::string::npos);
  EXPECT_NO_THROW(detail::expect_apart("op", {b_read, c_read}));                          // two reads
  EXPECT_NO_THROW(detail::expect_apart("op", {a, MemorySpan{"d", bytes + 32, 32, true}}));  // adjacent
  EXPECT_NO_THROW(detail::expect_apart("op", {a, MemorySpan{"e", nullptr, 32, true}}));     // absent
  EXPECT_NO_THROW(detail::expect_apart("op", {a, MemorySpan{"f", bytes, 0, true}}));        // empty
}

// Whether `call` threw an Error for `argument` of `op` that names `other` as what it overlaps.
template <typename F>
::testing::AssertionResult refused_overlap(F&& call, const std::string& op, const std::string& argument,
                                           const std::string& other) {
  const std::string what = error_of(call);
  if (what.find(op + ": argument '" + argument + "'") != 0 ||
      what.find("apart from " + other + " (") == std::string::npos) {
    return ::testing::AssertionFailure() << "threw \"" << what << "\"";
  }
  return ::testing::AssertionSuccess() << what;
}

// An output inside an input (or another output, the workspace, the cache) is refused before
// anything is written: o over q, lse inside o, the workspace over o, o over the cache, the fault
// record over q.
TEST(BadInput, DecodeOutputsSharingMemory) {
  DecodeCase c;
  const std::vector<std::uint8_t> q_before = c.q.byte_vector();
  const std::vector<std::uint8_t> cache_before = c.f.cache_bytes;

  MlaDecodeParams p = c.params();
  p.o.data = c.q.raw() + 64;  // 8 KB of o inside q's 18 KB
  EXPECT_TRUE(refused_overlap([&] { cpu::mla_decode(p); }, "mla_decode", "o", "q"));
  p = c.params();
  p.lse.data = c.o.raw() + 64;
  EXPECT_TRUE(refused_overlap([&] { cpu::mla_decode(p); }, "mla_decode", "o", "lse"));
  p = c.params();
  p.workspace = c.o.raw();
  p.workspace_bytes = 16;
  EXPECT_TRUE(refused_overlap([&] { cpu::mla_decode(p); }, "mla_decode", "o", "workspace"));
  p = c.params();
  p.o.data = c.f.cache_bytes.data();
  EXPECT_TRUE(refused_overlap([&] { cpu::mla_decode(p); }, "mla_decode", "o", "cache.data"));
  p = c.params();
  p.fault = reinterpret_cast<DeviceFault*>(c.q.raw());
  EXPECT_TRUE(refused_overlap([&] { cpu::mla_decode(p); }, "mla_decode", "fault", "q"));

  EXPECT_EQ(c.q.byte_vector(), q_before);
  EXPECT_EQ(c.f.cache_bytes, cache_before);
  EXPECT_TRUE(c.outputs_untouched());
}

// Memory the call only reads may be shared, and outputs may sit side by side in one buffer: o
// with lse right behind it computes what separate buffers do.
TEST(BadInput, AdjacentOutputsAndSharedReadsRun) {
  DecodeCase c;
  MlaDecodeParams p = c.params();
  cpu::mla_decode(p);
  HostTensor both = sentinel_tensor(DType::kU8, {static_cast<std::int64_t>(c.o.bytes() + c.lse.bytes())});
  p.o.data = both.raw();
  p.lse.data = both.raw() + c.o.bytes();
  cpu::mla_decode(p);
  EXPECT_TRUE(std::equal(c.o.raw(), c.o.raw() + c.o.bytes(), both.raw()));
  EXPECT_TRUE(std::equal(c.lse.raw(), c.lse.raw() + c.lse.bytes(), both.raw() + c.o.bytes()));

  // A top-k whose lengths are read out of its block table's own memory: two reads of the same
  // bytes select what separate buffers do.
  std::vector<std::int32_t> table = {1, 2, 0, 3, 5, 4};  // [2, 3] pages of 4 tokens; as lengths: 2, 0
  std::vector<std::int32_t> lens = {2, 0};
  HostTensor logits = random_f32(c.rng, {2, 1, 12}, -1, 1);
  HostTensor apart = sentinel_tensor(DType::kI32, {2, 1, 4}), shared = sentinel_tensor(DType::kI32, {2, 1, 4});
  TopkParams t = c.topk_params(logits, apart, 4);
  t.block_table = TensorView::contiguous(table.data(), DType::kI32, {2, 3});
  t.seq_lens = TensorView::contiguous(lens.data(), DType::kI32, {2});
  cpu::topk(t);
  t.slots = shared.view();
  t.seq_lens.data = table.data() + 1;
  EXPECT_NO_THROW(cpu::topk(t));
  EXPECT_EQ(shared.byte_vector(), apart.byte_vector());
}

// Every op's workspace: bytes without a buffer are refused before anything is written, whether or
// not the op would use them; a workspace the CPU reference does not use changes nothing.
TEST(BadInput, WorkspaceBytesWithoutABuffer) {
  constexpr std::size_t kBytes = 64;
  alignas(16) std::uint8_t scratch[kBytes] = {};
  // Refused while null, then run with `scratch` as the workspace.
  const auto refused_then_run = [&](auto params, auto run, const char* op) {
    params.workspace_bytes = kBytes;
    params.workspace = nullptr;
    const bool refused = throws_error([&] { run(params); }, op, "workspace", "null");
    params.workspace = scratch;
    run(params);
    return refused;
  };
  IndexerCase t;
  const std::vector<std::uint8_t> blank = t.logits.byte_vector();
  EXPECT_TRUE(refused_then_run(t.params(), [&](const IndexerLogitsParams& p) {
    EXPECT_EQ(t.logits.byte_vector(), blank);
    cpu::indexer_logits(p);
  }, "indexer_logits"));
  EXPECT_FALSE(is_sentinel(t.logits));

  DecodeCase c;
  EXPECT_TRUE(refused_then_run(c.params(), [&](const MlaDecodeParams& p) {
    EXPECT_TRUE(c.outputs_untouched());
    cpu::mla_decode(p);
  }, "mla_decode"));
  EXPECT_FALSE(c.outputs_untouched());

  fill_sentinel(c.o);
  fill_sentinel(c.lse);
  HostTensor idx = valid_indices(c);
  EXPECT_TRUE(refused_then_run(c.sparse_params(idx), [&](const SparseMlaDecodeParams& p) {
    EXPECT_TRUE(c.outputs_untouched());
    cpu::sparse_mla_decode(p);
  }, "sparse_mla_decode"));
  EXPECT_FALSE(c.outputs_untouched());

  HostTensor qp = random_bf16(c.rng, {2, 4, kQkDim});
  HostTensor op = sentinel_tensor(DType::kBF16, {2, 4, kLatentDim}), lp = sentinel_tensor(DType::kF32, {2, 4});
  HostTensor idxp = i32_tensor({2, 2}, {3, -1, -1, 5});
  EXPECT_TRUE(refused_then_run(c.sparse_prefill_params(qp, idxp, op, lp), [&](const SparseMlaPrefillParams& p) {
    EXPECT_TRUE(is_sentinel(op));
    cpu::sparse_mla_prefill(p);
  }, "sparse_mla_prefill"));
  EXPECT_FALSE(is_sentinel(op));

  PrefillCase pc;
  EXPECT_TRUE(refused_then_run(pc.params(), [&](const MlaPrefillParams& p) {
    EXPECT_TRUE(pc.outputs_untouched());
    cpu::mla_prefill(p);
  }, "mla_prefill"));
  EXPECT_FALSE(pc.outputs_untouched());

  HostTensor logits = random_f32(c.rng, {2, 1, 12}, -1, 1);
  HostTensor slots = sentinel_tensor(DType::kI32, {2, 1, 4});
  EXPECT_TRUE(refused_then_run(c.topk_params(logits, slots, 4), [&](const TopkParams& p) {
    EXPECT_TRUE(is_sentinel(slots));
    cpu::topk(p);
  }, "topk"));
  EXPECT_FALSE(is_sentinel(slots));

  HostTensor q_idx = random_fp8(c.rng, {4, 4, kIndexerDim});
  HostTensor w = random_f32(c.rng, {4, 4}, -1, 1);
  HostTensor rows = sentinel_tensor(DType::kI32, {4, 2});
  std::vector<std::int32_t> cu = {0, 4, 4};
  EXPECT_TRUE(refused_then_run(
      indexer_prefill_params(q_idx, w, cu, c.f.indexer(), c.f.block_table_view(), c.f.seq_lens_view(), rows),
      [&](const IndexerPrefillParams& p) {
        EXPECT_TRUE(is_sentinel(rows));
        cpu::indexer_prefill(p);
      },
      "indexer_prefill"));
  EXPECT_FALSE(is_sentinel(rows));
}

// The ops that write through other outputs than o: each refuses an overlap, naming both.
TEST(BadInput, EveryOpRefusesOverlappingArguments) {
  DecodeCase c;
  // mla_prefill: lse inside q.
  PrefillCase pc;
  MlaPrefillParams prefill = pc.params();
  prefill.lse.data = pc.q.raw() + 32;
  EXPECT_TRUE(refused_overlap([&] { cpu::mla_prefill(prefill); }, "mla_prefill", "lse", "q"));
  EXPECT_TRUE(pc.outputs_untouched());
  // sparse_mla_decode: its index rows inside o (o over the index rows would run past them into
  // whatever the heap put next, which the check may name first).
  HostTensor idx = valid_indices(c);
  SparseMlaDecodeParams sparse = c.sparse_params(idx);
  sparse.indices.data = sparse.o.data;
  EXPECT_TRUE(refused_overlap([&] { cpu::sparse_mla_decode(sparse); }, "sparse_mla_decode", "o", "indices"));
  EXPECT_TRUE(c.outputs_untouched());
  // sparse_mla_prefill: lse inside o.
  HostTensor qp = random_bf16(c.rng, {2, 4, kQkDim});
  HostTensor op = sentinel_tensor(DType::kBF16, {2, 4, kLatentDim}), lp = sentinel_tensor(DType::kF32, {2, 4});
  HostTensor idxp = i32_tensor({2, 2}, {3, -1, -1, 5});
  SparseMlaPrefillParams sp = c.sparse_prefill_params(qp, idxp, op, lp);
  sp.lse.data = op.raw() + 128;
  EXPECT_TRUE(refused_overlap([&] { cpu::sparse_mla_prefill(sp); }, "sparse_mla_prefill", "o", "lse"));
  EXPECT_TRUE(is_sentinel(op));
  // top-k: slots over the logits it reads.
  HostTensor logits = random_f32(c.rng, {2, 1, 12}, -1, 1);
  const std::vector<std::uint8_t> logits_before = logits.byte_vector();
  HostTensor slots = sentinel_tensor(DType::kI32, {2, 1, 4});
  TopkParams topk = c.topk_params(logits, slots, 4);
  topk.slots.data = logits.raw();
  EXPECT_TRUE(refused_overlap([&] { cpu::topk(topk); }, "topk", "slots", "logits"));
  EXPECT_EQ(logits.byte_vector(), logits_before);
  // indexer_logits: the weights read out of the logits' memory, and a clear range over the logits.
  IndexerCase t;
  IndexerLogitsParams ip = t.params();
  ip.weights.data = t.logits.raw();
  EXPECT_TRUE(refused_overlap([&] { cpu::indexer_logits(ip); }, "indexer_logits", "logits", "weights"));
  ip = t.params();
  ip.clear = t.logits.raw() + 16;
  ip.clear_bytes = 16;
  EXPECT_TRUE(refused_overlap([&] { cpu::indexer_logits(ip); }, "indexer_logits", "logits", "clear"));
  EXPECT_TRUE(is_sentinel(t.logits));
  // indexer_prefill: slots over the weights.
  HostTensor q_idx = random_fp8(c.rng, {4, 4, kIndexerDim});
  HostTensor w = random_f32(c.rng, {4, 4}, -1, 1);
  const std::vector<std::uint8_t> w_before = w.byte_vector();
  HostTensor rows = sentinel_tensor(DType::kI32, {4, 2});
  std::vector<std::int32_t> cu = {0, 4, 4};
  IndexerPrefillParams xp =
      indexer_prefill_params(q_idx, w, cu, c.f.indexer(), c.f.block_table_view(), c.f.seq_lens_view(), rows);
  xp.slots.data = w.raw() + 8;
  EXPECT_TRUE(refused_overlap([&] { cpu::indexer_prefill(xp); }, "indexer_prefill", "slots", "weights"));
  EXPECT_EQ(w.byte_vector(), w_before);
}

// The append writes the caches: the tokens it reads must not lie in them, nor one cache in the other.
TEST(BadInput, AppendInputsInsideTheCache) {
  AppendCase c;
  AppendParams p = c.params();
  p.latent.data = c.f.cache_bytes.data() + 16;
  EXPECT_TRUE(refused_overlap([&] { cpu::append(p); }, "append", "cache.data", "latent"));
  EXPECT_TRUE(c.unchanged());
  p = c.params();
  p.slots.data = c.f.indexer_bytes.data();
  EXPECT_TRUE(refused_overlap([&] { cpu::append(p); }, "append", "indexer.data", "slots"));
  EXPECT_TRUE(c.unchanged());
  p = c.params();
  p.indexer_keys.data = c.f.indexer_bytes.data() + 32;
  EXPECT_TRUE(refused_overlap([&] { cpu::append(p); }, "append", "indexer.data", "indexer_keys"));
  EXPECT_TRUE(c.unchanged());
  p = c.params();
  p.indexer.data = c.f.cache_bytes.data() + c.f.cache_bytes.size() - 64;  // its first bytes the cache's last
  EXPECT_TRUE(refused_overlap([&] { cpu::append(p); }, "append", "cache.data", "indexer.data"));
  EXPECT_TRUE(c.unchanged());
}

// span_of counts a cache's pages and a contiguous view's elements; a descriptor its checks would
// refuse counts nothing (they name it first).
TEST(BadInput, SpanBytes) {
  DecodeCase c;
  EXPECT_EQ(detail::span_of("cache", c.f.cache(), false).bytes, c.f.cache_bytes.size());
  EXPECT_EQ(detail::span_of("indexer", c.f.indexer(), false).bytes, c.f.indexer_bytes.size());
  EXPECT_EQ(detail::span_of("q", c.q.view(), false).bytes, c.q.bytes());
  TensorView wrapping = c.q.view();
  wrapping.shape = {std::int64_t{1} << 40, std::int64_t{1} << 40, 1, 1};
  EXPECT_EQ(detail::span_of("q", wrapping, false).bytes, 0u);
  LatentCache negative = c.f.cache();
  negative.num_pages = -1;
  EXPECT_EQ(detail::span_of("cache", negative, false).bytes, 0u);
  TensorView negative_extent = c.q.view();
  negative_extent.shape[1] = -1;
  EXPECT_EQ(detail::span_of("q", negative_extent, false).bytes, 0u);
  LatentCache largest = c.f.cache();  // 2^31 - 64 slots of 656 bytes: 1.4 TB, counted in full
  largest.page_size = 64;
  largest.num_pages = INT32_MAX / 64;
  EXPECT_EQ(largest.bytes(), std::size_t{INT32_MAX / 64} * 64 * 656);
  EXPECT_EQ(detail::span_of("cache", largest, false).bytes, largest.bytes());
}

}  // namespace
}  // namespace latentkv::testing
