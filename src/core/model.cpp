#include "latentkv/model.hpp"

#include <cmath>
#include <string>

#include "latentkv/error.hpp"

namespace latentkv {
namespace {

ModelPreset make_glm5() {
  ModelPreset m;
  m.name = "glm5";
  m.layers = 78;
  m.heads = 64;
  m.softmax_scale = 1.0 / std::sqrt(256.0);  // 0.0625
  m.indexer_heads = 32;
  m.indexer_rope = IndexerRope::kInterleaved;
  m.max_positions = 202752;
  return m;
}

ModelPreset make_deepseek_v32() {
  ModelPreset m;
  m.name = "deepseek-v3.2";
  m.layers = 61;
  m.heads = 128;
  const double mscale = 0.1 * std::log(40.0) + 1.0;  // YaRN mscale for factor 40
  m.softmax_scale = mscale * mscale / std::sqrt(192.0);
  m.indexer_heads = 64;
  m.indexer_rope = IndexerRope::kHalfSplit;
  m.max_positions = 163840;
  return m;
}

const std::vector<ModelPreset>& presets() {
  static const std::vector<ModelPreset> all = {make_glm5(), make_deepseek_v32()};
  return all;
}

}  // namespace

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const auto& m : presets()) names.push_back(m.name);
  return names;
}

const ModelPreset& model_preset(std::string_view name) {
  for (const auto& m : presets()) {
    if (m.name == name) return m;
  }
  std::string known;
  for (const auto& m : presets()) known += (known.empty() ? "" : ", ") + m.name;
  throw Error("model", "model", quoted_value(name), "one of: " + known);
}

ModelShard shard_model(const ModelPreset& model, int tp) {
  if (tp < 1 || model.heads % tp != 0) {
    throw Error("model", "tp", std::to_string(tp),
                "a positive divisor of " + model.name + "'s " + std::to_string(model.heads) + " attention heads");
  }
  return ModelShard{model, tp, model.heads / tp};
}

}  // namespace latentkv
