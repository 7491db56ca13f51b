#include "placeholder_data.h"

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <sstream>
#include <unordered_map>

namespace torch_xla_ext {
namespace {

std::atomic<PlaceholderData::Handle> last_issued_id{0};

// The lazy-tensor core needs a device type object; placeholders only record
// the ordinal, since no buffer is ever placed on the device.
torch::lazy::BackendDevice MakeDevice(int64_t ordinal) {
  return torch::lazy::BackendDevice(
      std::make_shared<torch::lazy::BackendDeviceType>(), ordinal);
}

struct Registry {
  std::mutex mutex;
  std::unordered_map<PlaceholderData::Handle, std::weak_ptr<PlaceholderData>>
      by_id;
  size_t prune_at = 64;

  // Drops expired entries. Insertion prunes each time the map doubles past the
  // last live size, so the cost is amortized O(1) and the map stays within
  // twice the live set.
  void Prune() {
    for (auto it = by_id.begin(); it != by_id.end();) {
      it = it->second.expired() ? by_id.erase(it) : std::next(it);
    }
    prune_at = std::max<size_t>(64, 2 * by_id.size());
  }
};

Registry& GetRegistry() {
  static Registry* registry = new Registry();  // never destroyed: used at exit
  return *registry;
}

}  // namespace

namespace {

// Checked before the id is taken, so a rejected placeholder uses up no id.
const std::vector<int64_t>& CheckedSizes(const std::vector<int64_t>& sizes) {
  for (int64_t size : sizes) {
    if (size < 0) {
      throw std::invalid_argument("placeholder sizes must be non-negative, got " +
                                  std::to_string(size));
    }
  }
  return sizes;
}

}  // namespace

PlaceholderData::PlaceholderData(std::vector<int64_t> sizes,
                                 c10::ScalarType dtype, int64_t device_ordinal)
    : torch::lazy::BackendData(MakeDevice(device_ordinal),
                               torch::lazy::Shape(dtype, CheckedSizes(sizes))),
      id_(++last_issued_id) {}

void PlaceholderData::Assign(const torch::lazy::BackendData& /*data*/) {
  throw PlaceholderValueError(
      "cannot assign a value to " + Describe() +
      ": a placeholder only stands for a shape and a dtype during tracing");
}

std::string PlaceholderData::Describe() const {
  std::ostringstream out;
  out << c10::getDtypeNames(shape().scalar_type()).first << "[";
  const auto& sizes = shape().sizes();
  for (size_t i = 0; i < sizes.size(); ++i) {
    out << (i ? "," : "") << sizes[i];
  }
  out << "] placeholder #" << id_;
  return out.str();
}

PlaceholderData::Handle PlaceholderData::IdsIssued() {
  return last_issued_id.load();
}

PlaceholderDataPtr CreatePlaceholder(std::vector<int64_t> sizes,
                                     c10::ScalarType dtype,
                                     int64_t device_ordinal) {
  auto data =
      std::make_shared<PlaceholderData>(std::move(sizes), dtype, device_ordinal);
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mutex);
  if (registry.by_id.size() >= registry.prune_at) {
    registry.Prune();
  }
  registry.by_id.emplace(data->id(), data);
  return data;
}

PlaceholderDataPtr FindPlaceholder(PlaceholderData::Handle id) {
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mutex);
  auto it = registry.by_id.find(id);
  return it == registry.by_id.end() ? nullptr : it->second.lock();
}

size_t LivePlaceholderCount() {
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mutex);
  registry.Prune();
  return registry.by_id.size();
}

std::vector<PlaceholderDataPtr> LivePlaceholders() {
  std::vector<PlaceholderDataPtr> live;
  {
    Registry& registry = GetRegistry();
    std::lock_guard<std::mutex> lock(registry.mutex);
    live.reserve(registry.by_id.size());
    for (const auto& entry : registry.by_id) {
      if (auto data = entry.second.lock()) {
        live.push_back(std::move(data));
      }
    }
  }
  std::sort(live.begin(), live.end(),
            [](const PlaceholderDataPtr& a, const PlaceholderDataPtr& b) {
              return a->id() < b->id();
            });
  return live;
}

}  // namespace torch_xla_ext
