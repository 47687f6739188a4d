// latentkv/model.hpp - the attention shapes of the supported models (SPEC section 2).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace latentkv {

enum class IndexerRope { kInterleaved, kHalfSplit };

struct ModelPreset {
  std::string name;          // "glm5", "deepseek-v3.2"
  int layers = 0;            // every layer uses DSA
  int heads = 0;             // attention heads before tensor parallelism
  int kv_lora_rank = 512;    // latent width = d_v
  int rope_dim = 64;         // qk_rope_head_dim
  int d_qk = 576;            // absorbed query/key width
  int d_v = 512;             // value width (the latent)
  double softmax_scale = 0;  // applied to q.k
  int indexer_heads = 0;     // replicated on every GPU
  int indexer_dim = 128;
  int index_topk = 2048;
  IndexerRope indexer_rope = IndexerRope::kInterleaved;
  int max_positions = 0;
};

// The preset for `name` ("glm5" or "deepseek-v3.2"); throws Error listing the known names.
const ModelPreset& model_preset(std::string_view name);
std::vector<std::string> model_preset_names();

// A preset placed on one GPU of a tensor-parallel group: tp divides the attention heads.
struct ModelShard {
  ModelPreset model;
  int tp = 1;
  int heads_per_gpu = 0;  // model.heads / tp
};

// Throws Error when tp < 1 or tp does not divide the heads.
ModelShard shard_model(const ModelPreset& model, int tp);

}  // namespace latentkv
