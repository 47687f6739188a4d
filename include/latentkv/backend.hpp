// latentkv/backend.hpp - the backend interface: what a backend can run, and running it.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "latentkv/cache.hpp"
#include "latentkv/dtype.hpp"
#include "latentkv/ops.hpp"

namespace latentkv {

enum class Op : std::uint8_t {
  kAppend,
  kMlaDecode,
  kMlaPrefill,
  kIndexerLogits,
  kTopk,
  kSparseMlaDecode,
  kSparseMlaPrefill,
  kIndexerPrefill,
};
inline constexpr Op kAllOps[] = {Op::kAppend,          Op::kMlaDecode,       Op::kMlaPrefill,
                                 Op::kIndexerLogits,   Op::kTopk,            Op::kSparseMlaDecode,
                                 Op::kSparseMlaPrefill, Op::kIndexerPrefill};
std::string_view op_name(Op op);  // "append", "mla_decode", ...

// The device an op runs on. sm is the compute capability x 10 (90 for an H200), 0 on the CPU.
struct DeviceInfo {
  DeviceKind kind = DeviceKind::kCpu;
  int sm = 0;
  int index = 0;
  std::string name = "cpu";
  int multiprocessors = 0;
};
// The current CUDA device (cudaGetDevice) when the library was built with CUDA and one is present, else
// the CPU: also when the CUDA runtime cannot be used (no driver, or one too old for it), so that a
// configuration resolved for it picks the CPU reference. Asks the runtime on every call: a program
// that calls ops often passes the DeviceInfo it detected once (run(), plan_dsa_decode(), ...).
DeviceInfo detect_device();

// What a kernel must handle, known before any tensor exists (from the configuration) or read off an
// op's parameters. A field of 0 means "not fixed yet": a backend answers for the values it is given.
struct Problem {
  Op op = Op::kMlaDecode;
  KvDtype kv_dtype = KvDtype::kFp8E4M3;
  int heads = 0;      // query heads on this GPU (indexer heads for kIndexerLogits, kIndexerPrefill)
  int page_size = 0;  // tokens per page
  int q_len = 0;      // new tokens per request in decode
  int topk = 0;       // k of kTopk; index columns of the sparse ops
  DeviceInfo device;
};

using OpArgs = std::variant<AppendParams, MlaDecodeParams, MlaPrefillParams, IndexerLogitsParams, TopkParams,
                            SparseMlaDecodeParams, SparseMlaPrefillParams, IndexerPrefillParams>;
Op op_of(const OpArgs& args);
Problem problem_of(const OpArgs& args, const DeviceInfo& device);

struct ExecContext {
  // cudaStream_t for CUDA backends; unused on the CPU. The default, null, is CUDA's legacy default
  // stream, which waits for (and holds up) the device's other blocking streams: an engine passes
  // the stream its step runs on.
  void* stream = nullptr;
};

// A runnable kernel: its name (for printing), its launcher, and the launcher's own checks of a call.
// `check` throws what `launch` would refuse in a call whose shapes are valid without reading the
// data (pointer alignment, grid limits, the planned split count and workspace), queueing nothing;
// dsa_decode and dsa_prefill run every step's check before they queue the first step. `launch`
// checks the same again. A Kernel built directly may leave `check` empty; one from make_kernel
// always checks at least the op of its parameters (the reference's checks no more: its refusals of
// bad values, NaN or slots outside the pool, need the data and come from its launch).
struct Kernel {
  std::string name;
  std::function<void(const OpArgs&, const ExecContext&)> launch;
  std::function<void(const OpArgs&)> check = {};
};
// A kernel selected for `op` whose launch and check first refuse the parameters of any other op
// (Error naming `op`, the kernel and the op the parameters are for), so that a kernel kept from
// select() cannot be handed another op's call. The library's backends make theirs with it.
Kernel make_kernel(Op op, std::string name, std::function<void(const OpArgs&, const ExecContext&)> launch,
                   std::function<void(const OpArgs&)> check = {});

// A schedule fixed before a step runs: how the work is split and how much device scratch it needs.
// It depends only on shapes and the device (never on per-step lengths), so a captured CUDA graph
// stays valid as lengths grow.
struct Plan {
  int num_splits = 1;
  int chunk_tokens = 0;  // new tokens per chunk, for ops that work through them in chunks (indexer_prefill)
  std::size_t workspace_bytes = 0;
  // Leading bytes of the workspace the op can take already zeroed, saving it a pass (0: it always
  // clears what it needs itself). See TopkParams::workspace_cleared.
  std::size_t cleared_bytes = 0;
};

// The answer of Backend::select: a kernel, or the reason there is none.
struct Selection {
  std::optional<Kernel> kernel;
  std::string reason;  // why not, when there is no kernel; how it was chosen otherwise

  explicit operator bool() const { return kernel.has_value(); }
  static Selection no(std::string why) { return {std::nullopt, std::move(why)}; }
  static Selection yes(Kernel k, std::string how = {}) { return {std::move(k), std::move(how)}; }
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;
  virtual std::string_view description() const = 0;
  // Higher wins when `auto` chooses among backends that support a problem.
  virtual int preference() const = 0;
  // Bytes it moves beyond the op's own (a cast of the cache), in words; empty when none.
  virtual std::string_view extra_traffic() const { return {}; }
  // The one function that answers both "is this supported?" and "which kernel runs".
  virtual Selection select(const Problem& problem) const = 0;
  // The schedule and scratch for a call with these shapes; callers copy num_splits and a workspace
  // of workspace_bytes into the parameters. No scratch by default. A backend may throw Error for
  // shapes its planner cannot count with, as the call would (the cuda backend and the cast
  // baselines: q without heads, a page size below one token, negative extents of q, index rows,
  // logits, block tables, lengths and offsets, more requests than a GPU call takes: see ops.hpp);
  // the rest is checked by the call.
  virtual Plan plan(const OpArgs& args, const DeviceInfo& device) const {
    (void)args;
    (void)device;
    return {};
  }
};

// The device of memory at `where`, as a backend selects for it: the CPU for host memory (also on a
// machine with a GPU); for CUDA memory, detect_device(), the calling thread's current device, which
// validation then holds every view of the call to (a view on another GPU is refused, naming it, as
// are CUDA views where no CUDA device can be used).
DeviceInfo device_info_for(Device where);
// The device a call runs on where its caller names none: device_info_for its cache's memory (the
// top-k's: its logits').
DeviceInfo device_of(const OpArgs& args);

// Selects on `backend` for the op's own problem and launches it; throws Error naming the op, the
// backend and the reason when the backend cannot run it. The device selected for is `device`, or
// without it the device of the call's tensors (device_of): a call of the reference on host tensors
// runs on the CPU wherever it is made, and one of a CUDA backend on host tensors is refused as
// running on the CPU, the refusal ending with the view that chose it ("; a call that names no
// device runs where its cache.device is (cpu)"). A GPU call launches on the calling thread's current
// CUDA device, which a `device` given must be (on a machine of several GPUs, cudaSetDevice first: a
// view on another GPU is refused, naming it; Backend::plan alone switches to device.index while it
// plans). A GPU call may be captured in a CUDA graph once a call of the same shapes has run outside
// the capture on that device (its kernels' first launches there set them up: latentkv/dsa.hpp).
void run(const Backend& backend, const OpArgs& args, const ExecContext& context = {});
void run(const Backend& backend, const OpArgs& args, const ExecContext& context, const DeviceInfo& device);

// Every backend compiled into the library, in registration order.
const std::vector<const Backend*>& registered_backends();
// nullptr when no backend has that name.
const Backend* find_backend(std::string_view name);

}  // namespace latentkv
