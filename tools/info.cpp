// `latentkv info`: the version, the device, the model presets and the registered backends.
#include <cstdio>
#include <string>

#include "commands.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/cache.hpp"
#include "latentkv/model.hpp"
#include "latentkv/version.hpp"

namespace latentkv::tools {

void add_info_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("info", "Show the version, the device, the model presets and the registered backends");
  cmd->callback([] {
    std::printf("latentkv %s\n", library_description());
    const DeviceInfo device = detect_device();
    if (device.kind == DeviceKind::kCpu) {
      std::printf("device: cpu (no CUDA device%s)\n",
#ifdef LKV_WITH_CUDA
                  " found"
#else
                  "; built without CUDA"
#endif
      );
    } else {
      std::printf("device: %s, sm_%d, %d multiprocessors\n", device.name.c_str(), device.sm, device.multiprocessors);
    }
    std::printf("\nmodels:\n");
    for (const std::string& name : model_preset_names()) {
      const ModelPreset& m = model_preset(name);
      std::printf("  %-14s %2d layers, %3d heads, d_qk %d, d_v %d, scale %.6f, indexer %d x %d, topk %d\n",
                  m.name.c_str(), m.layers, m.heads, m.d_qk, m.d_v, m.softmax_scale, m.indexer_heads, m.indexer_dim,
                  m.index_topk);
    }
    std::printf("\ncache formats: fp8_e4m3 %zu B/token, bf16 %zu B/token, indexer %zu B/token\n", kFp8TokenBytes,
                kBf16TokenBytes, kIndexerTokenBytes);
    std::printf("\nbackends:\n");
    for (const Backend* b : registered_backends()) {
      std::printf("  %-12s %s\n", std::string(b->name()).c_str(), std::string(b->description()).c_str());
    }
  });
}

}  // namespace latentkv::tools
