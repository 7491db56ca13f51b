// The Python face of the C++ core: torch_xla_ext._C.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>  // torch.dtype <-> c10::ScalarType

#include "parameter_table.h"
#include "placeholder_data.h"

#include <string>
#include <tuple>
#include <vector>

namespace py = pybind11;
using torch_xla_ext::ParameterKey;
using torch_xla_ext::ParameterTable;
using torch_xla_ext::PlaceholderData;

namespace {

const char* KindName(ParameterKey::Kind kind) {
  return kind == ParameterKey::Kind::kPlaceholder ? "placeholder"
                                                  : "device_data";
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "C++ core of torch_xla_ext: placeholder data and parameter plans";

  py::register_exception<torch_xla_ext::PlaceholderValueError>(
      m, "PlaceholderError", PyExc_RuntimeError);

  py::class_<PlaceholderData, std::shared_ptr<PlaceholderData>>(
      m, "PlaceholderData")
      .def_property_readonly("id", &PlaceholderData::id)
      .def_property_readonly(
          "sizes", [](PlaceholderData& d) { return d.shape().sizes().vec(); })
      .def_property_readonly(
          "dtype", [](PlaceholderData& d) { return d.shape().scalar_type(); })
      .def_property_readonly("device_ordinal",
                             [](PlaceholderData& d) { return d.device().ordinal(); })
      .def("has_value", &PlaceholderData::HasValue)
      .def("assign", [](PlaceholderData& d) { d.Assign(d); })
      .def("describe", &PlaceholderData::Describe)
      .def("__repr__", [](PlaceholderData& d) {
        return "<PlaceholderData " + d.Describe() + ">";
      });

  m.def(
      "create_placeholder",
      [](std::vector<int64_t> sizes, c10::ScalarType dtype,
         int64_t device_ordinal) {
        try {
          return torch_xla_ext::CreatePlaceholder(std::move(sizes), dtype,
                                                  device_ordinal);
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
      },
      py::arg("sizes"), py::arg("dtype"), py::arg("device_ordinal") = 0,
      "Creates and registers a placeholder with a new process-unique id.");
  m.def("find_placeholder", &torch_xla_ext::FindPlaceholder, py::arg("id"),
        "The live placeholder with this id, or None.");
  m.def("live_placeholder_count", &torch_xla_ext::LivePlaceholderCount);
  m.def(
      "live_placeholders",
      [] {
        // Plain values, so that the caller's list keeps no placeholder alive.
        std::vector<std::tuple<int64_t, c10::ScalarType, std::vector<int64_t>,
                               std::string>>
            out;
        for (const auto& data : torch_xla_ext::LivePlaceholders()) {
          out.emplace_back(data->id(), data->shape().scalar_type(),
                           data->shape().sizes().vec(), data->Describe());
        }
        return out;
      },
      "(id, dtype, sizes, description) of each registered placeholder alive "
      "now, oldest first.");
  m.def("ids_issued", &PlaceholderData::IdsIssued);

  py::class_<ParameterTable>(m, "ParameterTable")
      .def(py::init<>())
      .def(
          "use_placeholder",
          [](ParameterTable& t, int64_t id) {
            return t.Use({ParameterKey::Kind::kPlaceholder, id});
          },
          py::arg("placeholder_id"))
      .def(
          "use_device_data",
          [](ParameterTable& t, int64_t handle) {
            return t.Use({ParameterKey::Kind::kDeviceData, handle});
          },
          py::arg("handle"))
      .def_property_readonly("parameters",
                             [](const ParameterTable& t) {
                               std::vector<std::pair<std::string, int64_t>> out;
                               for (const auto& key : t.parameters()) {
                                 out.emplace_back(KindName(key.kind), key.value);
                               }
                               return out;
                             })
      .def_property_readonly("use_indices", &ParameterTable::use_indices);
}
