#include "backend/key_grads.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <utility>

namespace torch_odc {

namespace {

// Sets one bit of the noted set after autograd accumulated a gradient into the parameter.
class NoteGradHook : public torch::autograd::FunctionPostHook {
 public:
  NoteGradHook(std::shared_ptr<void> noted, std::mutex* mu, std::vector<uint64_t>* bits,
               size_t index)
      : noted_(std::move(noted)), mu_(mu), bits_(bits), index_(index) {}
  // Runs on the autograd engine's thread, right after the accumulation.
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    std::lock_guard<std::mutex> lock(*mu_);
    (*bits_)[index_ / 64] |= uint64_t{1} << (index_ % 64);
    return outputs;
  }
  // Compiled autograd would have to trace the hook; it has no traceable form.
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {
    TORCH_CHECK_NOT_IMPLEMENTED(false,
                                "torch_odc: compiled autograd is not supported with "
                                "torch_odc.attach (the hooks that note which parameters got a "
                                "gradient run in C++); run backward without compiled autograd");
  }

 private:
  std::shared_ptr<void> noted_;  // keeps the set alive while the hook exists
  std::mutex* mu_;
  std::vector<uint64_t>* bits_;
  size_t index_;
};

}  // namespace

KeyGrads::KeyGrads(size_t num_params)
    : num_params_(num_params),
      noted_(std::make_shared<Noted>()),
      hooks_(num_params),
      all_bits_((num_params + 63) / 64, 0) {
  noted_->bits.assign((num_params + 63) / 64, 0);
}

KeyGrads::~KeyGrads() { unwatchAll(); }

void KeyGrads::unhook(Hook& h) {
  if (h.accumulator) h.accumulator->del_post_hook(h.key);
  h = Hook{};
}

bool KeyGrads::watch(size_t index, const at::Tensor& param) {
  TORCH_CHECK(index < num_params_, "odc: parameter #", index, " out of range");
  Hook& h = hooks_[index];
  if (h.accumulator && h.param == param.unsafeGetTensorImpl()) return true;
  unhook(h);
  auto accumulator = torch::autograd::impl::grad_accumulator(param);
  if (!accumulator) return false;
  h.key = accumulator->add_post_hook(
      std::make_unique<NoteGradHook>(noted_, &noted_->mu, &noted_->bits, index));
  h.accumulator = accumulator.get();
  h.holder = std::make_shared<decltype(accumulator)>(std::move(accumulator));
  h.param = param.unsafeGetTensorImpl();
  return true;
}

void KeyGrads::unwatchAll() {
  for (auto& h : hooks_) unhook(h);
}

void KeyGrads::note(size_t index) {
  TORCH_CHECK(index < num_params_, "odc: parameter #", index, " out of range");
  std::lock_guard<std::mutex> lock(noted_->mu);
  noted_->bits[index / 64] |= uint64_t{1} << (index % 64);
}

namespace {

std::vector<int64_t> setBits(const std::vector<uint64_t>& bits, size_t n) {
  std::vector<int64_t> out;
  for (size_t i = 0; i < n; ++i) {
    if (bits[i / 64] >> (i % 64) & 1) out.push_back(static_cast<int64_t>(i));
  }
  return out;
}

}  // namespace

std::vector<int64_t> KeyGrads::pushed() const {
  std::lock_guard<std::mutex> lock(noted_->mu);
  return setBits(noted_->bits, num_params_);
}

std::vector<int64_t> KeyGrads::takePushed() {
  // Read and cleared under one lock: a note made in between is neither lost nor taken twice.
  std::lock_guard<std::mutex> lock(noted_->mu);
  auto out = setBits(noted_->bits, num_params_);
  std::fill(noted_->bits.begin(), noted_->bits.end(), 0);
  return out;
}

void KeyGrads::setPlaceholders(const std::vector<int64_t>& indices,
                               std::vector<at::Tensor> placeholders) {
  TORCH_CHECK(indices.size() == placeholders.size(),
              "odc: setPlaceholders needs one placeholder per index");
  std::fill(all_bits_.begin(), all_bits_.end(), 0);
  for (const int64_t i : indices) {
    TORCH_CHECK(i >= 0 && static_cast<size_t>(i) < num_params_, "odc: parameter #", i,
                " out of range");
    all_bits_[static_cast<size_t>(i) / 64] |= uint64_t{1} << (i % 64);
  }
  indices_ = indices;
  placeholders_ = std::move(placeholders);
}

namespace {

void checkCount(size_t got, size_t want, const char* what) {
  TORCH_CHECK(got == want, "odc: ", what, ": ", got, " tensors for ", want, " parameters");
}

}  // namespace

bool KeyGrads::placeAll(const std::vector<at::Tensor>& sharded) {
  if (placeholders_.empty()) return false;
  checkCount(sharded.size(), placeholders_.size(), "placeAll");
  for (const auto& p : sharded) {
    if (p.grad().defined()) return false;
  }
  for (size_t i = 0; i < sharded.size(); ++i) {
    sharded[i].mutable_grad() = placeholders_[i];
  }
  return true;
}

bool KeyGrads::finalize(const std::vector<at::Tensor>& sharded,
                        const std::vector<at::Tensor>& views, const std::vector<bool>& got) {
  if (views.empty() || placeholders_.empty()) return false;
  checkCount(sharded.size(), placeholders_.size(), "finalize");
  checkCount(views.size(), placeholders_.size(), "finalize (views)");
  for (const int64_t i : indices_) {
    TORCH_CHECK(static_cast<size_t>(i) < got.size(), "odc: finalize: no flag for parameter #", i);
  }
  for (size_t j = 0; j < sharded.size(); ++j) {
    auto& grad = sharded[j].mutable_grad();
    if (got[static_cast<size_t>(indices_[j])]) {
      grad = views[j];
    } else {
      grad.reset();
    }
  }
  return true;
}

bool KeyGrads::takeAll(const std::vector<at::Tensor>& sharded) {
  if (placeholders_.empty()) return false;
  checkCount(sharded.size(), placeholders_.size(), "takeAll");
  std::lock_guard<std::mutex> lock(noted_->mu);
  if (noted_->bits != all_bits_) return false;
  for (size_t i = 0; i < sharded.size(); ++i) {
    const auto& grad = sharded[i].grad();
    if (!grad.defined() || grad.unsafeGetTensorImpl() != placeholders_[i].unsafeGetTensorImpl()) {
      return false;
    }
  }
  for (const auto& p : sharded) p.mutable_grad().reset();
  std::fill(noted_->bits.begin(), noted_->bits.end(), 0);
  return true;
}

bool KeyGrads::allGradsSet(const std::vector<at::Tensor>& sharded) const {
  if (placeholders_.empty()) return false;
  checkCount(sharded.size(), placeholders_.size(), "allGradsSet");
  for (const auto& p : sharded) {
    if (!p.grad().defined()) return false;
  }
  return true;
}

}  // namespace torch_odc
