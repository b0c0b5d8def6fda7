#include "common/selector.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cpu/selectors.h"
#include "common/status_macros.h"

namespace gtopk {

absl::Status ValidateSelectorOptions(const SelectorOptions& options) {
  if (!(options.dgc_sample_fraction >= 0.01 &&
        options.dgc_sample_fraction <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dgc_sample_fraction must be in [0.01, 1], got ",
                     options.dgc_sample_fraction));
  }
  if (options.gaussiank_max_adjustments < 1 ||
      options.gaussiank_max_adjustments > 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("gaussiank_max_adjustments must be in [1, 16], got ",
                     options.gaussiank_max_adjustments));
  }
  return absl::OkStatus();
}

absl::Status ValidateSelectArgs(uint64_t n, uint64_t k) {
  if (n == 0) {
    return absl::InvalidArgumentError("selector input is empty (n = 0)");
  }
  if (n > kMaxDenseLength) {
    return absl::InvalidArgumentError(absl::StrCat(
        "selector input has n = ", n, " entries; at most 2^32 are supported"));
  }
  if (k == 0) {
    return absl::InvalidArgumentError("k must be at least 1, got 0");
  }
  if (k > n) {
    return absl::InvalidArgumentError(
        absl::StrCat("k = ", k, " exceeds the input length n = ", n));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> KFromDensity(double density, uint64_t n) {
  if (!(density > 0.0 && density <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("density must be in (0, 1], got ", density));
  }
  if (n == 0) {
    return absl::InvalidArgumentError("density given for n = 0 entries");
  }
  if (n > kMaxDenseLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("n = ", n, " entries; at most 2^32 are supported"));
  }
  const double k = std::round(density * static_cast<double>(n));
  if (k < 1.0) return uint64_t{1};
  return std::min<uint64_t>(n, static_cast<uint64_t>(k));
}

absl::Status SelectorRegistry::Register(std::string name,
                                        SelectorFactory factory) {
  if (name.empty()) {
    return absl::InvalidArgumentError("selector name must not be empty");
  }
  if (factories_.count(name) != 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("selector \"", name, "\" is already registered"));
  }
  factories_.emplace(std::move(name), std::move(factory));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Selector>> SelectorRegistry::Create(
    absl::string_view name, const SelectorOptions& options) const {
  auto it = factories_.find(name);
  if (it == factories_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown selector \"", name,
                     "\"; known: ", absl::StrJoin(Names(), ", ")));
  }
  GTOPK_RETURN_IF_ERROR(ValidateSelectorOptions(options));
  return it->second(options);
}

absl::Status SelectorRegistry::RegisterDevice(std::string name,
                                              DeviceSelectorFactory factory) {
  if (factories_.count(name) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device selector \"", name, "\" is not a registered selector; known: ",
        absl::StrJoin(Names(), ", ")));
  }
  if (device_factories_.count(name) != 0) {
    return absl::AlreadyExistsError(absl::StrCat(
        "selector \"", name, "\" already has a device implementation"));
  }
  device_factories_.emplace(std::move(name), std::move(factory));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Selector>> SelectorRegistry::CreateDevice(
    absl::string_view name, const SelectorOptions& options,
    uint64_t capacity) const {
  if (factories_.find(name) == factories_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown selector \"", name,
                     "\"; known: ", absl::StrJoin(Names(), ", ")));
  }
  auto it = device_factories_.find(name);
  if (it == device_factories_.end()) {
    const std::vector<std::string> device_names = DeviceNames();
    return absl::InvalidArgumentError(absl::StrCat(
        "selector \"", name, "\" has no device implementation; ",
        device_names.empty()
            ? std::string("none is registered")
            : absl::StrCat("with one: ", absl::StrJoin(device_names, ", "))));
  }
  GTOPK_RETURN_IF_ERROR(ValidateSelectorOptions(options));
  return it->second(options, capacity);
}

std::vector<std::string> SelectorRegistry::Names() const {
  std::vector<std::string> names;
  for (const auto& entry : factories_) names.push_back(entry.first);
  return names;
}

std::vector<std::string> SelectorRegistry::DeviceNames() const {
  std::vector<std::string> names;
  for (const auto& entry : device_factories_) names.push_back(entry.first);
  return names;
}

absl::Status RegisterBuiltinSelectors(SelectorRegistry* registry) {
  GTOPK_RETURN_IF_ERROR(registry->Register(
      "exact",
      [](const SelectorOptions&) -> absl::StatusOr<std::unique_ptr<Selector>> {
        return std::make_unique<cpu::ExactSelector>();
      }));
  GTOPK_RETURN_IF_ERROR(
      registry->Register("gaussiank",
                         [](const SelectorOptions& o)
                             -> absl::StatusOr<std::unique_ptr<Selector>> {
                           return std::make_unique<cpu::GaussianKSelector>(o);
                         }));
  GTOPK_RETURN_IF_ERROR(
      registry->Register("dgc",
                         [](const SelectorOptions& o)
                             -> absl::StatusOr<std::unique_ptr<Selector>> {
                           return std::make_unique<cpu::DgcSelector>(o);
                         }));
  GTOPK_RETURN_IF_ERROR(
      registry->Register("randomk",
                         [](const SelectorOptions& o)
                             -> absl::StatusOr<std::unique_ptr<Selector>> {
                           return std::make_unique<cpu::RandomKSelector>(o);
                         }));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Selector>> CreateSelector(
    absl::string_view name, const SelectorOptions& options) {
  SelectorRegistry registry;
  GTOPK_RETURN_IF_ERROR(RegisterBuiltinSelectors(&registry));
  return registry.Create(name, options);
}

}  // namespace gtopk
