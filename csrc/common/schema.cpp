#include "common/schema.h"

#include <ATen/ops/empty.h>

#include <mutex>
#include <unordered_map>

namespace rl_losses {
namespace schema {

OpSchema& OpSchema::args(const Entries& entries) {
  for (const Entry& e : entries) {
    if (keyword_ && !star_written_) {
      args_.emplace_back("*");
      star_written_ = true;
    }
    std::string a = e.type;
    if (first_mutable_ && args_.empty()) a += "(a!)";
    a += std::string(" ") + e.name;
    if (defaults_ && e.dflt[0] != '\0') a += std::string("=") + e.dflt;
    args_.push_back(std::move(a));
  }
  return *this;
}

OpSchema& OpSchema::results(const Entries& entries) {
  for (const Entry& e : entries) results_.push_back({e.type, e.name});
  return *this;
}

std::string OpSchema::str() const {
  std::string s = name_ + "(";
  bool writes = false;
  for (size_t i = 0; i < args_.size(); ++i) {
    s += (i ? ", " : "") + args_[i];
    writes = writes || args_[i].find('!') != std::string::npos;
  }
  s += ") -> (";
  for (size_t i = 0; i < results_.size(); ++i) {
    // torch.compile functionalises an op that writes an argument only where its results are plain tensors: there a
    // result the kernel may leave out is an empty tensor (Args::push_results).
    const bool plain = writes && std::string(results_[i].first) == "Tensor?";
    s += (i ? ", " : "") + std::string(plain ? "Tensor" : results_[i].first) + " " + results_[i].second;
  }
  return s + ")";
}

Args::Args(const c10::OperatorHandle& op, torch::jit::Stack* stack) : schema_(op.schema()), stack_(stack) {
  const size_t n = schema_.arguments().size();
  args_.assign(std::make_move_iterator(stack->end() - n), std::make_move_iterator(stack->end()));
  torch::jit::drop(*stack, n);
  results_.resize(schema_.returns().size());
}

std::string Args::op_name() const {
  const std::string& name = schema_.name();
  return name.substr(name.find("::") + 2);
}

const int* Args::positions(const char* const* names, size_t n, bool returns) const {
  // Keyed by the schema and the group's (static) list of names: the lookups run once per op and group.
  struct Key {
    const void* schema;
    const void* names;
    bool returns;
    bool operator==(const Key& o) const { return schema == o.schema && names == o.names && returns == o.returns; }
  };
  struct Hash {
    size_t operator()(const Key& k) const {
      return std::hash<const void*>()(k.schema) * 31 + std::hash<const void*>()(k.names) * 2 + k.returns;
    }
  };
  static std::mutex mutex;
  static std::unordered_map<Key, std::vector<int>, Hash> cache;
  const Key key{&schema_, names, returns};
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it == cache.end()) {
    const auto& list = returns ? schema_.returns() : schema_.arguments();
    std::vector<int> pos(n, -1);
    for (size_t i = 0; i < n; ++i) {
      for (size_t j = 0; j < list.size(); ++j) {
        if (list[j].name() == names[i]) pos[i] = static_cast<int>(j);
      }
    }
    it = cache.emplace(key, std::move(pos)).first;
  }
  return it->second.data();
}

const int* PositionCache::add(const Args& args, const char* const* names, size_t n, bool returns) {
  const int* positions = args.positions(names, n, returns);
  std::lock_guard<std::mutex> lock(mutex_);
  const size_t used = used_.load(std::memory_order_relaxed);
  for (size_t i = 0; i < used; ++i) {
    if (slots_[i].schema == &args.schema()) return positions;
  }
  if (used < kSlots) {
    slots_[used] = {&args.schema(), positions};
    used_.store(used + 1, std::memory_order_release);
  }
  return positions;
}

c10::IValue& Args::arg(const char* name) {
  const auto i = schema_.argumentIndexWithName(name);
  if (!i) missing_argument(*this, name);
  return args_[*i];
}

void Args::set_result(int position, at::Tensor t) {
  TORCH_INTERNAL_ASSERT(position >= 0, schema_.name(), ": a kernel sets a result the schema does not return");
  results_[position] = std::move(t);
}

void Args::push_results() {
  // A result the kernel left out: None (results_' initial value) where the schema says `Tensor?`; an empty 1-D
  // tensor of the first result's dtype and device in an op that writes an argument (OpSchema::str).
  const bool plain = schema_.is_mutable() && !results_.empty() && results_[0].isTensor();
  const at::TensorOptions first = plain ? results_[0].toTensor().options() : at::TensorOptions();
  for (size_t i = 0; i < results_.size(); ++i) {
    if (plain && results_[i].isNone() && schema_.returns()[i].type()->kind() != c10::TypeKind::OptionalType) {
      results_[i] = at::empty({0}, first);
    }
    TORCH_INTERNAL_ASSERT(results_[i].isTensor() || schema_.returns()[i].type()->kind() == c10::TypeKind::OptionalType,
                          schema_.name(), ": the kernel set no result '", schema_.returns()[i].name(), "'");
    stack_->push_back(std::move(results_[i]));
  }
}

Call& Call::set(const char* name, c10::IValue value) {
  const auto i = op_.schema().argumentIndexWithName(name);
  TORCH_INTERNAL_ASSERT(i.has_value(), op_.schema().name(), " has no argument '", name, "'");
  stack_[*i] = std::move(value);
  return *this;
}

Call& Call::run() {
  TORCH_INTERNAL_ASSERT(stack_.size() == op_.schema().arguments().size(), op_.schema().name(), ": ", stack_.size(),
                        " arguments for ", op_.schema().arguments().size());
  op_.callBoxed(stack_);
  return *this;
}

at::Tensor Call::result(const char* name) const {
  const auto& returns = op_.schema().returns();
  for (size_t i = 0; i < returns.size(); ++i) {
    if (returns[i].name() == name) return stack_[i].toTensor();
  }
  TORCH_INTERNAL_ASSERT(false, op_.schema().name(), " returns no '", name, "'");
}

void missing_argument(const Args& args, const char* name) {
  TORCH_INTERNAL_ASSERT(false, args.schema().name(), " has no argument '", name,
                        "' that its kernel reads (csrc/op_args.h)");
}

}  // namespace schema
}  // namespace rl_losses
