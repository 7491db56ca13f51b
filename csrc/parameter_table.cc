#include "parameter_table.h"

#include "placeholder_data.h"

namespace torch_xla_ext {

ParameterKey KeyOf(torch::lazy::BackendData& data) {
  if (auto* placeholder = dynamic_cast<PlaceholderData*>(&data)) {
    return {ParameterKey::Kind::kPlaceholder, placeholder->id()};
  }
  return {ParameterKey::Kind::kDeviceData, data.GetHandle()};
}

int64_t ParameterTable::Use(const ParameterKey& key) {
  auto [it, inserted] =
      index_of_.emplace(key, static_cast<int64_t>(parameters_.size()));
  if (inserted) {
    parameters_.push_back(key);
  }
  use_indices_.push_back(it->second);
  return it->second;
}

}  // namespace torch_xla_ext
