// Per key (one FSDP2 unit), the autograd side of its pushes: which of its parameters got a
// gradient since the key's last push, and the no-memory placeholders in the sharded parameters'
// .grad that the common push swaps out.
//
// A gradient is noted by a post-hook on each unsharded parameter's gradient accumulator
// (autograd's AccumulateGrad node, hooked as DDP's reducer hooks it): C++ called by the autograd
// engine, no Python per parameter and backward. The accumulators are held here, so autograd
// reuses them (and their hooks) in every graph.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace torch_odc {

class KeyGrads {
 public:
  explicit KeyGrads(size_t num_params);
  ~KeyGrads();
  KeyGrads(const KeyGrads&) = delete;
  KeyGrads& operator=(const KeyGrads&) = delete;

  // Notes every gradient accumulated into `param` as one of parameter `index` (FSDP2's unsharded
  // parameter). Replaces the hook of an earlier tensor at `index`. False, and nothing hooked,
  // for a tensor that has no gradient accumulator (not a leaf, or not requiring grad).
  bool watch(size_t index, const at::Tensor& param);
  // Removes every hook (detach).
  void unwatchAll();

  // Notes parameter `index` as a hook does (benchmarks call it to stand for a backward).
  void note(size_t index);
  // The parameters noted since the last take, ascending; take* also clears them.
  std::vector<int64_t> pushed() const;
  std::vector<int64_t> takePushed();

  // The trainable parameters (indices) and their placeholders, as Python made them; an empty
  // list turns takeAll off. The sharded parameters themselves (and the barrier's views) are not
  // held here: each call below gets them, unpacked from the Python objects at the call, so that
  // nothing of ODC raises the use or weak count FSDP2's ``_apply`` (``model.to()``) checks
  // before it swaps the tensor inside a parameter (and inside its .grad), and every call sees
  // the tensor the parameter holds now. `sharded` is in the order of `indices`.
  void setPlaceholders(const std::vector<int64_t>& indices, std::vector<at::Tensor> placeholders);
  size_t numPlaced() const { return indices_.size(); }
  // The common push: every trainable parameter, and no other, got a gradient, and each holds its
  // placeholder in .grad. Then clears those .grad (FSDP2 sets them after the reduce-scatter) and
  // the noted set, and returns true; otherwise changes nothing and returns false.
  bool takeAll(const std::vector<at::Tensor>& sharded);
  // Entering a minibatch, the common case: no sharded parameter given to setPlaceholders has a
  // .grad. Then puts each one's placeholder there and returns true; otherwise changes nothing and
  // returns false.
  bool placeAll(const std::vector<at::Tensor>& sharded);
  // The barrier, where placeAll entered the minibatch: each sharded parameter's .grad becomes its
  // view (`views`: of its accumulator span, in the gradient dtype, as Python made them) where
  // `got` (per parameter of the key) says it got a gradient, else None. False, and nothing
  // changed, without views.
  bool finalize(const std::vector<at::Tensor>& sharded, const std::vector<at::Tensor>& views,
                const std::vector<bool>& got);
  // Whether every sharded parameter given to setPlaceholders has a .grad (false without any).
  bool allGradsSet(const std::vector<at::Tensor>& sharded) const;

 private:
  struct Noted {
    std::mutex mu;
    std::vector<uint64_t> bits;
  };
  struct Hook {
    // Keeps the accumulator alive: a shared_ptr or, from torch 2.15, an intrusive_ptr to it.
    std::shared_ptr<void> holder;
    torch::autograd::Node* accumulator = nullptr;
    uintptr_t key = 0;
    const void* param = nullptr;  // the hooked tensor's TensorImpl (identity only)
  };
  void unhook(Hook& h);

  size_t num_params_;
  std::shared_ptr<Noted> noted_;  // shared with the hooks
  std::vector<Hook> hooks_;
  std::vector<uint64_t> all_bits_;  // the trainable parameters
  std::vector<int64_t> indices_;    // of placeholders_ (and of the callers' sharded and views)
  std::vector<at::Tensor> placeholders_;
};

}  // namespace torch_odc
