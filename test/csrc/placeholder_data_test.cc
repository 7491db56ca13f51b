// Unit tests for torch_xla_ext::PlaceholderData and its registry.
#include "placeholder_data.h"

#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "check.h"

using torch_xla_ext::CreatePlaceholder;
using torch_xla_ext::FindPlaceholder;
using torch_xla_ext::LivePlaceholderCount;
using torch_xla_ext::PlaceholderData;
using torch_xla_ext::PlaceholderDataPtr;
using torch_xla_ext::PlaceholderValueError;
using Handle = PlaceholderData::Handle;

namespace {

void TestIdsDistinctAndIncreasing() {
  const Handle issued_before = PlaceholderData::IdsIssued();
  std::vector<PlaceholderDataPtr> alive;
  Handle previous = issued_before;
  for (int i = 0; i < 100; ++i) {
    alive.push_back(CreatePlaceholder({i}, c10::kFloat));
    const Handle id = alive.back()->id();
    EXPECT_GT(id, 0);
    EXPECT_EQ(id, previous + 1);  // ids are handed out one by one
    EXPECT_EQ(PlaceholderData::IdsIssued(), id);
    previous = id;
  }
  // Directly constructed placeholders draw from the same counter.
  PlaceholderData direct({2}, c10::kInt);
  EXPECT_EQ(direct.id(), previous + 1);
  EXPECT_EQ(PlaceholderData::IdsIssued(), issued_before + 101);
}

void TestIdsNeverReusedAcrossCreateFreeCycles() {
  std::set<Handle> seen;
  Handle previous = PlaceholderData::IdsIssued();
  std::set<const void*> addresses;
  int reused_address = 0;
  for (int i = 0; i < 10000; ++i) {
    Handle id;
    const void* address;
    if (i % 2 == 0) {
      auto data = CreatePlaceholder({i % 7, 3}, c10::kFloat);
      id = data->id();
      address = data.get();
    } else {
      auto data = std::make_unique<PlaceholderData>(
          std::vector<int64_t>{3, i % 5}, c10::kBFloat16);
      id = data->id();
      address = data.get();
    }  // freed here
    reused_address += addresses.insert(address).second ? 0 : 1;
    EXPECT_TRUE(seen.insert(id).second);
    EXPECT_GT(id, previous);
    previous = id;
  }
  EXPECT_EQ(seen.size(), 10000u);
  // The point of ids: allocators do reuse addresses across cycles like these,
  // yet the ids above stayed unique. (Informational, not required.)
  std::fprintf(stderr, "  (addresses reused in %d of 10000 cycles)\n",
               reused_address);
}

void TestIdsUniqueAcrossThreads() {
  constexpr int kThreads = 4;
  constexpr int kPerThread = 2000;
  std::mutex mutex;
  std::set<Handle> seen;
  int duplicates = 0;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      std::vector<Handle> ids;
      for (int i = 0; i < kPerThread; ++i) {
        ids.push_back(CreatePlaceholder({1}, c10::kFloat)->id());
      }
      std::lock_guard<std::mutex> lock(mutex);
      for (Handle id : ids) {
        duplicates += seen.insert(id).second ? 0 : 1;
      }
    });
  }
  for (auto& thread : threads) {
    thread.join();
  }
  EXPECT_EQ(duplicates, 0);
  EXPECT_EQ(seen.size(), static_cast<size_t>(kThreads * kPerThread));
}

void TestHandleIsIdAndNoValue() {
  PlaceholderData data({2, 3}, c10::kFloat, /*device_ordinal=*/3);
  EXPECT_EQ(data.GetHandle(), data.id());
  torch::lazy::BackendData& base = data;
  EXPECT_EQ(base.GetHandle(), data.id());
  EXPECT_FALSE(base.HasValue());
  EXPECT_FALSE(data.HasValue());
  // The shape, dtype and device it was made with are kept.
  EXPECT_EQ(data.shape().scalar_type(), c10::kFloat);
  EXPECT_EQ(data.shape().sizes().size(), 2u);
  EXPECT_EQ(data.shape().sizes()[0], 2);
  EXPECT_EQ(data.shape().sizes()[1], 3);
  EXPECT_EQ(data.device().ordinal(), 3);
  EXPECT_EQ(PlaceholderData({1}, c10::kFloat).device().ordinal(), 0);
}

void TestAssignThrowsWithDescription() {
  PlaceholderData data({4, 5}, c10::kFloat);
  PlaceholderData other({4, 5}, c10::kFloat);
  std::string what;
  EXPECT_THROW_WHAT(data.Assign(other), PlaceholderValueError, what);
  EXPECT_CONTAINS(what, data.Describe());
  EXPECT_CONTAINS(what, "cannot assign");
  // Through the base class as well, and PlaceholderValueError is a
  // std::runtime_error so generic handlers catch it.
  torch::lazy::BackendData& base = data;
  std::string base_what;
  EXPECT_THROW_WHAT(base.Assign(other), std::runtime_error, base_what);
  EXPECT_EQ(base_what, what);
  EXPECT_FALSE(data.HasValue());  // still nothing after the failed assign
}

void TestNegativeSizeThrows() {
  std::string what;
  EXPECT_THROW_WHAT(PlaceholderData bad({2, -1}, c10::kFloat),
                    std::invalid_argument, what);
  EXPECT_CONTAINS(what, "-1");
  EXPECT_CONTAINS(what, "non-negative");

  const size_t live_before = LivePlaceholderCount();
  std::string create_what;
  EXPECT_THROW_WHAT((void)CreatePlaceholder({-3}, c10::kFloat),
                    std::invalid_argument, create_what);
  EXPECT_CONTAINS(create_what, "-3");
  EXPECT_EQ(LivePlaceholderCount(), live_before);  // nothing registered

  // Zero sizes and scalars (no sizes) are fine.
  PlaceholderData empty({0, 4}, c10::kFloat);
  PlaceholderData scalar({}, c10::kFloat);
  EXPECT_EQ(scalar.shape().sizes().size(), 0u);
}

void TestDescribe() {
  // The dtype as torch names it, the sizes, the id.
  PlaceholderData data({2, 3}, c10::kFloat);
  const std::string text = data.Describe();
  EXPECT_EQ(text, "float32[2,3] placeholder #" + std::to_string(data.id()));
  PlaceholderData half({4, 2}, c10::kBFloat16);
  EXPECT_EQ(half.Describe(),
            "bfloat16[4,2] placeholder #" + std::to_string(half.id()));
  PlaceholderData scalar({}, c10::kInt);
  EXPECT_EQ(scalar.Describe(),
            "int32[] placeholder #" + std::to_string(scalar.id()));
  PlaceholderData zero({0}, c10::kBool);
  EXPECT_EQ(zero.Describe(), "bool[0] placeholder #" + std::to_string(zero.id()));
  // Two placeholders of the same shape are told apart by their ids.
  PlaceholderData twin({2, 3}, c10::kFloat);
  EXPECT_NE(twin.Describe(), text);
}

void TestRegistryFindAndExpiry() {
  const size_t live_before = LivePlaceholderCount();
  auto a = CreatePlaceholder({2}, c10::kFloat);
  auto b = CreatePlaceholder({3}, c10::kHalf, /*device_ordinal=*/1);
  EXPECT_EQ(LivePlaceholderCount(), live_before + 2);
  EXPECT_TRUE(FindPlaceholder(a->id()) == a);
  EXPECT_TRUE(FindPlaceholder(b->id()) == b);
  EXPECT_EQ(FindPlaceholder(b->id())->device().ordinal(), 1);

  // Unknown ids are not found.
  EXPECT_TRUE(FindPlaceholder(0) == nullptr);
  EXPECT_TRUE(FindPlaceholder(-1) == nullptr);
  EXPECT_TRUE(FindPlaceholder(PlaceholderData::IdsIssued() + 1) == nullptr);

  // Placeholders made without CreatePlaceholder are not registered.
  PlaceholderData unregistered({1}, c10::kFloat);
  EXPECT_TRUE(FindPlaceholder(unregistered.id()) == nullptr);
  EXPECT_EQ(LivePlaceholderCount(), live_before + 2);

  // A find keeps the placeholder alive only as long as its result.
  const Handle a_id = a->id();
  const Handle b_id = b->id();
  auto found = FindPlaceholder(a_id);
  a.reset();
  EXPECT_TRUE(FindPlaceholder(a_id) == found);
  EXPECT_EQ(LivePlaceholderCount(), live_before + 2);
  found.reset();
  EXPECT_TRUE(FindPlaceholder(a_id) == nullptr);
  EXPECT_EQ(LivePlaceholderCount(), live_before + 1);
  b.reset();
  EXPECT_TRUE(FindPlaceholder(b_id) == nullptr);
  EXPECT_EQ(LivePlaceholderCount(), live_before);
}

void TestRegistryManyLiveAndExpired() {
  // Enough to go past the registry's pruning threshold several times while a
  // subset stays alive: the live ones must stay findable throughout.
  const size_t live_before = LivePlaceholderCount();
  std::vector<PlaceholderDataPtr> kept;
  std::vector<Handle> dropped;
  for (int i = 0; i < 1000; ++i) {
    auto data = CreatePlaceholder({i}, c10::kFloat);
    if (i % 3 == 0) {
      kept.push_back(data);
    } else {
      dropped.push_back(data->id());
    }
  }
  EXPECT_EQ(LivePlaceholderCount(), live_before + kept.size());
  int missing = 0;
  for (const auto& data : kept) {
    missing += FindPlaceholder(data->id()) == data ? 0 : 1;
  }
  EXPECT_EQ(missing, 0);
  int resurrected = 0;
  for (Handle id : dropped) {
    resurrected += FindPlaceholder(id) == nullptr ? 0 : 1;
  }
  EXPECT_EQ(resurrected, 0);
  kept.clear();
  EXPECT_EQ(LivePlaceholderCount(), live_before);
}

void TestLivePlaceholdersInIdOrder() {
  const size_t live_before = torch_xla_ext::LivePlaceholders().size();
  std::vector<PlaceholderDataPtr> kept;
  for (int i = 0; i < 300; ++i) {
    auto data = CreatePlaceholder({i}, c10::kFloat);
    if (i % 4 == 0) {
      kept.push_back(data);
    }
  }
  PlaceholderData unregistered({1}, c10::kFloat);
  auto live = torch_xla_ext::LivePlaceholders();
  CHECK_EQ(live.size(), live_before + kept.size());
  EXPECT_EQ(live.size(), LivePlaceholderCount());
  // Oldest first: the ones kept here are the newest, in creation order.
  int out_of_order = 0;
  for (size_t i = 1; i < live.size(); ++i) {
    out_of_order += live[i - 1]->id() < live[i]->id() ? 0 : 1;
  }
  EXPECT_EQ(out_of_order, 0);
  int wrong = 0;
  for (size_t i = 0; i < kept.size(); ++i) {
    wrong += live[live_before + i] == kept[i] ? 0 : 1;
  }
  EXPECT_EQ(wrong, 0);
  // The list shares ownership while it lives; the registry itself does not.
  const Handle first_id = kept.front()->id();
  kept.clear();
  EXPECT_TRUE(FindPlaceholder(first_id) != nullptr);  // `live` holds it
  live.clear();
  EXPECT_TRUE(FindPlaceholder(first_id) == nullptr);
  EXPECT_EQ(torch_xla_ext::LivePlaceholders().size(), live_before);
}

}  // namespace

int main() {
  check::Run("ids distinct and increasing", TestIdsDistinctAndIncreasing);
  check::Run("ids never reused across 10000 create/free cycles",
             TestIdsNeverReusedAcrossCreateFreeCycles);
  check::Run("ids unique across threads", TestIdsUniqueAcrossThreads);
  check::Run("GetHandle is the id, HasValue is false",
             TestHandleIsIdAndNoValue);
  check::Run("Assign throws PlaceholderValueError with the description",
             TestAssignThrowsWithDescription);
  check::Run("negative size throws std::invalid_argument",
             TestNegativeSizeThrows);
  check::Run("Describe text", TestDescribe);
  check::Run("registry find and expiry", TestRegistryFindAndExpiry);
  check::Run("registry with many live and expired entries",
             TestRegistryManyLiveAndExpired);
  check::Run("LivePlaceholders: registered, alive, in id order",
             TestLivePlaceholdersInIdOrder);
  return check::Summary("placeholder_data_test");
}
