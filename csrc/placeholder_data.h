// A lazy-tensor BackendData that stands for a tensor with a shape and a dtype
// but no device buffer. Its handle is a process-unique id, so caches and
// lowering contexts keyed on it never confuse two placeholders, even after one
// is freed (torch_xla's own placeholders use object addresses, which are reused).
#pragma once

#include <torch/csrc/lazy/backend/backend_data.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace torch_xla_ext {

// Raised when code asks a placeholder for a value it does not have.
class PlaceholderValueError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class PlaceholderData : public torch::lazy::BackendData {
 public:
  PlaceholderData(std::vector<int64_t> sizes, c10::ScalarType dtype,
                  int64_t device_ordinal = 0);

  // The id, which is never reused within the process.
  Handle GetHandle() override { return id_; }
  Handle id() const { return id_; }

  // A placeholder never holds a value.
  bool HasValue() const override { return false; }
  [[noreturn]] void Assign(const torch::lazy::BackendData& data) override;

  // "float32[2,3] placeholder #7" (dtype as torch names it), the one
  // description of a placeholder that every error message uses.
  std::string Describe() const;

  // How many ids have been handed out so far (the next id is this plus one).
  static Handle IdsIssued();

 private:
  const Handle id_;
};

using PlaceholderDataPtr = std::shared_ptr<PlaceholderData>;

// Registry of the placeholders that are alive, by id. It holds them weakly:
// entries expire on their own when the last owner of a placeholder lets go of
// it, so the registry never keeps a placeholder alive.
PlaceholderDataPtr CreatePlaceholder(std::vector<int64_t> sizes,
                                     c10::ScalarType dtype,
                                     int64_t device_ordinal = 0);
PlaceholderDataPtr FindPlaceholder(PlaceholderData::Handle id);
size_t LivePlaceholderCount();
// The registered placeholders alive now, in order of id (oldest first).
std::vector<PlaceholderDataPtr> LivePlaceholders();

}  // namespace torch_xla_ext
