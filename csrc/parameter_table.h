// Plans the parameters of an HLO computation from the data it reads, the way a
// lowering context does: each distinct piece of data becomes one parameter.
// Placeholders are told apart by their ids and real device data by its device
// handle; the two live in separate key spaces, so a placeholder id can never
// be mistaken for a handle that happens to have the same value.
#pragma once

#include <torch/csrc/lazy/backend/backend_data.h>

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace torch_xla_ext {

struct ParameterKey {
  enum class Kind : uint8_t { kPlaceholder, kDeviceData };
  Kind kind;
  int64_t value;  // placeholder id, or device handle

  bool operator==(const ParameterKey& other) const {
    return kind == other.kind && value == other.value;
  }
};

// The key of a BackendData: its id when it is a PlaceholderData, else its
// device handle.
ParameterKey KeyOf(torch::lazy::BackendData& data);

class ParameterTable {
 public:
  // Records one use and returns the parameter index it binds to: a new index
  // for data not seen before, the earlier one otherwise.
  int64_t Use(const ParameterKey& key);
  int64_t Use(torch::lazy::BackendData& data) { return Use(KeyOf(data)); }

  // The distinct parameters, in order of first use.
  const std::vector<ParameterKey>& parameters() const { return parameters_; }
  // For each recorded use, in order, the parameter index it binds to.
  const std::vector<int64_t>& use_indices() const { return use_indices_; }

 private:
  struct KeyHash {
    size_t operator()(const ParameterKey& key) const {
      return std::hash<int64_t>()(key.value) * 2 +
             static_cast<size_t>(key.kind);
    }
  };
  std::unordered_map<ParameterKey, int64_t, KeyHash> index_of_;
  std::vector<ParameterKey> parameters_;
  std::vector<int64_t> use_indices_;
};

}  // namespace torch_xla_ext
