// Unit tests for torch_xla_ext::ParameterTable and KeyOf.
#include "parameter_table.h"

#include <memory>
#include <string>
#include <vector>

#include "check.h"
#include "placeholder_data.h"

using torch_xla_ext::KeyOf;
using torch_xla_ext::ParameterKey;
using torch_xla_ext::ParameterTable;
using torch_xla_ext::PlaceholderData;
using Kind = ParameterKey::Kind;

namespace {

// Stands for real device data: a BackendData with a value and a device handle
// chosen by the test.
class FakeDeviceData : public torch::lazy::BackendData {
 public:
  explicit FakeDeviceData(Handle handle)
      : torch::lazy::BackendData(
            torch::lazy::BackendDevice(
                std::make_shared<torch::lazy::BackendDeviceType>(), 0),
            torch::lazy::Shape(c10::kFloat, {2})),
        handle_(handle) {}

  Handle GetHandle() override { return handle_; }
  void Assign(const torch::lazy::BackendData& data) override {
    handle_ = const_cast<torch::lazy::BackendData&>(data).GetHandle();
  }
  bool HasValue() const override { return true; }

 private:
  Handle handle_;
};

int KindInt(Kind kind) { return static_cast<int>(kind); }

std::vector<int64_t> Indices(std::initializer_list<int64_t> values) {
  return std::vector<int64_t>(values);
}

std::string Join(const std::vector<int64_t>& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    out += (i ? "," : "") + std::to_string(values[i]);
  }
  return out + "]";
}

void TestKeyOfPlaceholder() {
  PlaceholderData placeholder({2, 3}, c10::kFloat);
  const ParameterKey key = KeyOf(placeholder);
  EXPECT_EQ(KindInt(key.kind), KindInt(Kind::kPlaceholder));
  EXPECT_EQ(key.value, placeholder.id());
  // Through a BackendData reference too (the dynamic type decides).
  torch::lazy::BackendData& base = placeholder;
  EXPECT_TRUE(KeyOf(base) == key);
}

void TestKeyOfDeviceData() {
  FakeDeviceData device(1234);
  const ParameterKey key = KeyOf(device);
  EXPECT_EQ(KindInt(key.kind), KindInt(Kind::kDeviceData));
  EXPECT_EQ(key.value, 1234);
  device.Assign(FakeDeviceData(99));  // the key follows the current handle
  EXPECT_EQ(KeyOf(device).value, 99);
}

void TestKeyEquality() {
  const ParameterKey p7{Kind::kPlaceholder, 7};
  const ParameterKey d7{Kind::kDeviceData, 7};
  EXPECT_TRUE(p7 == (ParameterKey{Kind::kPlaceholder, 7}));
  EXPECT_FALSE(p7 == d7);
  EXPECT_FALSE(p7 == (ParameterKey{Kind::kPlaceholder, 8}));
}

void TestSamePlaceholderThreeTimesIsOneParameter() {
  PlaceholderData placeholder({4}, c10::kFloat);
  ParameterTable table;
  EXPECT_EQ(table.Use(placeholder), 0);
  EXPECT_EQ(table.Use(placeholder), 0);
  EXPECT_EQ(table.Use(placeholder), 0);
  CHECK_EQ(table.parameters().size(), 1u);
  EXPECT_TRUE(table.parameters()[0] == KeyOf(placeholder));
  EXPECT_EQ(Join(table.use_indices()), Join(Indices({0, 0, 0})));
}

void TestTwoPlaceholdersAreTwoParameters() {
  // Same shape and dtype: only the id tells them apart.
  PlaceholderData a({4}, c10::kFloat);
  PlaceholderData b({4}, c10::kFloat);
  ParameterTable table;
  EXPECT_EQ(table.Use(a), 0);
  EXPECT_EQ(table.Use(b), 1);
  EXPECT_EQ(table.Use(a), 0);
  CHECK_EQ(table.parameters().size(), 2u);
  EXPECT_EQ(table.parameters()[0].value, a.id());
  EXPECT_EQ(table.parameters()[1].value, b.id());
}

void TestPlaceholderIdAndEqualHandleAreDistinct() {
  PlaceholderData placeholder({4}, c10::kFloat);
  // Real data whose device handle happens to equal the placeholder's id.
  FakeDeviceData device(placeholder.id());
  ParameterTable table;
  EXPECT_EQ(table.Use(placeholder), 0);
  EXPECT_EQ(table.Use(device), 1);
  EXPECT_EQ(table.Use(placeholder), 0);
  EXPECT_EQ(table.Use(device), 1);
  CHECK_EQ(table.parameters().size(), 2u);
  EXPECT_EQ(KindInt(table.parameters()[0].kind), KindInt(Kind::kPlaceholder));
  EXPECT_EQ(KindInt(table.parameters()[1].kind), KindInt(Kind::kDeviceData));
  EXPECT_EQ(table.parameters()[0].value, table.parameters()[1].value);

  // The same with raw keys, device data first, for a range of values.
  ParameterTable raw;
  for (int64_t v = -2; v < 50; ++v) {
    raw.Use({Kind::kDeviceData, v});
    raw.Use({Kind::kPlaceholder, v});
  }
  EXPECT_EQ(raw.parameters().size(), 104u);
}

void TestDeviceDataDedupsOnHandle() {
  FakeDeviceData a(10);
  FakeDeviceData same_buffer(10);  // another object, same device handle
  FakeDeviceData c(11);
  ParameterTable table;
  EXPECT_EQ(table.Use(a), 0);
  EXPECT_EQ(table.Use(same_buffer), 0);
  EXPECT_EQ(table.Use(c), 1);
  EXPECT_EQ(table.parameters().size(), 2u);
}

void TestUseIndicesOrder() {
  PlaceholderData p0({1}, c10::kFloat);
  PlaceholderData p1({1}, c10::kFloat);
  FakeDeviceData d0(500);
  FakeDeviceData d1(501);
  ParameterTable table;
  EXPECT_EQ(table.parameters().size(), 0u);
  EXPECT_EQ(table.use_indices().size(), 0u);
  // Uses:      p1 d0 p1 p0 d1 d0 p0 p1
  // Parameters in order of first use: p1=0 d0=1 p0=2 d1=3
  for (torch::lazy::BackendData* data :
       std::vector<torch::lazy::BackendData*>{&p1, &d0, &p1, &p0, &d1, &d0,
                                              &p0, &p1}) {
    table.Use(*data);
  }
  EXPECT_EQ(Join(table.use_indices()),
            Join(Indices({0, 1, 0, 2, 3, 1, 2, 0})));
  CHECK_EQ(table.parameters().size(), 4u);
  EXPECT_TRUE(table.parameters()[0] == KeyOf(p1));
  EXPECT_TRUE(table.parameters()[1] == KeyOf(d0));
  EXPECT_TRUE(table.parameters()[2] == KeyOf(p0));
  EXPECT_TRUE(table.parameters()[3] == KeyOf(d1));
}

void TestManyParameters() {
  // Past several rehashes of the table's map, indices stay stable.
  ParameterTable table;
  for (int64_t v = 0; v < 5000; ++v) {
    table.Use({v % 2 ? Kind::kDeviceData : Kind::kPlaceholder, v / 2});
  }
  int wrong = 0;
  for (int64_t v = 0; v < 5000; ++v) {
    wrong += table.Use({v % 2 ? Kind::kDeviceData : Kind::kPlaceholder,
                        v / 2}) == v
                 ? 0
                 : 1;
  }
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(table.parameters().size(), 5000u);
  EXPECT_EQ(table.use_indices().size(), 10000u);
}

}  // namespace

int main() {
  check::Run("KeyOf a placeholder", TestKeyOfPlaceholder);
  check::Run("KeyOf real device data", TestKeyOfDeviceData);
  check::Run("ParameterKey equality", TestKeyEquality);
  check::Run("same placeholder used 3 times -> 1 parameter",
             TestSamePlaceholderThreeTimesIsOneParameter);
  check::Run("two placeholders -> 2 parameters",
             TestTwoPlaceholdersAreTwoParameters);
  check::Run("placeholder id == device handle -> 2 parameters",
             TestPlaceholderIdAndEqualHandleAreDistinct);
  check::Run("device data dedups on handle", TestDeviceDataDedupsOnHandle);
  check::Run("use_indices order", TestUseIndicesOrder);
  check::Run("many parameters", TestManyParameters);
  return check::Summary("parameter_table_test");
}
