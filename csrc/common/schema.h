// Op arguments and results by name, with one home per option.
//
// Every argument of every op belongs to a *group*: an X-macro list of X(type, name, default) entries (csrc/op_args.h),
// where `type` is the C++ type a kernel reads (its schema type is SchemaType<type>), `name` the argument's name
// and `default` the public op's default in schema syntax (empty: none). From one list come
//   * the schema text of the public op and of its `_forward` ops (registration.cpp, through OpSchema), so that a
//     default is typed once, in the list;
//   * a struct with one field per entry (RL_LOSSES_ARG_GROUP), whose `read(Args&)` fills it from a boxed kernel's
//     stack by name: the position of each name in the op's schema is looked up once per schema and cached.
// Results are groups too (entries without a default): `write(Args&)` places each defined field at its return's
// position, by name, so a kernel never counts outputs.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <array>
#include <atomic>
#include <iterator>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace rl_losses {

// The C++ types of the schema types the ops use (one alias where the type has a comma or is long).
using OptTensor = std::optional<at::Tensor>;
using OptDouble = std::optional<double>;
using OptInt = std::optional<int64_t>;
using OptBool = std::optional<bool>;
using OptString = std::optional<std::string>;
using OptDoubles = std::optional<std::vector<double>>;
using OutputMask = std::array<bool, 3>;  // which of grad_hidden, grad_weight, grad_bias to compute
// An optional tensor the op writes into (`Tensor(a!)?`: a caller's buffer); read as the optional it is.
struct OptTensorOut : OptTensor {
  using OptTensor::OptTensor;
  using OptTensor::operator=;
};
// A result the op may leave out (`Tensor?`: None in Python, an undefined tensor in C++), e.g. a metric whose option
// is off: no allocation, and no tensor for the caller to wrap.
struct MaybeTensor : at::Tensor {
  MaybeTensor() = default;
  MaybeTensor(at::Tensor t) : at::Tensor(std::move(t)) {}  // NOLINT: a tensor is one
};

namespace schema {

template <class T>
struct SchemaType;
#define RL_LOSSES_SCHEMA_TYPE(T, text_) \
  template <>                           \
  struct SchemaType<T> {                \
    static constexpr const char* text = text_; \
  };
RL_LOSSES_SCHEMA_TYPE(at::Tensor, "Tensor")
RL_LOSSES_SCHEMA_TYPE(OptTensor, "Tensor?")
RL_LOSSES_SCHEMA_TYPE(OptTensorOut, "Tensor(a!)?")
RL_LOSSES_SCHEMA_TYPE(MaybeTensor, "Tensor?")
RL_LOSSES_SCHEMA_TYPE(double, "float")
RL_LOSSES_SCHEMA_TYPE(OptDouble, "float?")
RL_LOSSES_SCHEMA_TYPE(int64_t, "int")
RL_LOSSES_SCHEMA_TYPE(OptInt, "int?")
RL_LOSSES_SCHEMA_TYPE(bool, "bool")
RL_LOSSES_SCHEMA_TYPE(OptBool, "bool?")
RL_LOSSES_SCHEMA_TYPE(std::string, "str")
RL_LOSSES_SCHEMA_TYPE(OptString, "str?")
RL_LOSSES_SCHEMA_TYPE(OptDoubles, "float[]?")
RL_LOSSES_SCHEMA_TYPE(OutputMask, "bool[3]")
#undef RL_LOSSES_SCHEMA_TYPE

// One argument or result in schema syntax: type, name, default ("" for none).
struct Entry {
  const char* type;
  const char* name;
  const char* dflt;
};
using Entries = std::vector<Entry>;

// Assembles `name(<args>, *, <keyword args>) -> (<results>)` from groups' entries. Arguments after kwargs() are
// keyword-only; without_defaults() drops the defaults that follow (the `_forward` ops take every argument).
class OpSchema {
 public:
  explicit OpSchema(std::string name) : name_(std::move(name)) {}
  OpSchema& args(const Entries& entries);
  OpSchema& kwargs() {
    keyword_ = true;
    return *this;
  }
  OpSchema& without_defaults() {
    defaults_ = false;
    return *this;
  }
  // The first argument is written in place (`Tensor(a!)`): the `_forward_inplace` ops.
  OpSchema& first_mutable() {
    first_mutable_ = true;
    return *this;
  }
  OpSchema& results(const Entries& entries);
  std::string str() const;

 private:
  std::string name_;
  std::vector<std::string> args_;
  std::vector<std::pair<const char*, const char*>> results_;  // type, name
  bool keyword_ = false, defaults_ = true, first_mutable_ = false, star_written_ = false;
};

// A boxed kernel's arguments, taken off the stack and read by name, and its results, put back by name.
class Args {
 public:
  Args(const c10::OperatorHandle& op, torch::jit::Stack* stack);
  const c10::FunctionSchema& schema() const { return schema_; }
  // The op's name without the namespace, for messages.
  std::string op_name() const;

  // The positions of `names` among the schema's arguments (or its returns), -1 where absent; looked up on the
  // first call for this schema and list.
  const int* positions(const char* const* names, size_t n, bool returns) const;
  c10::IValue& arg(int position) { return args_[position]; }
  // All of them, in the schema's order (for a `_forward` op that takes the same list).
  const std::vector<c10::IValue>& arguments() const { return args_; }
  // One argument by name, for the few read outside a group.
  c10::IValue& arg(const char* name);
  void set_result(int position, at::Tensor t);
  // Every result set: push them, in the schema's order, onto the stack.
  void push_results();

  template <class Group>
  Group read() {
    Group g;
    g.read(*this);
    return g;
  }

 private:
  const c10::FunctionSchema& schema_;
  torch::jit::Stack* stack_;
  std::vector<c10::IValue> args_;
  std::vector<c10::IValue> results_;
};

// One group's positions in each schema that reads it (a group is read by a few ops): a short list read without a
// lock on every call, appended to on an op's first call (Args::positions, whose map and lock serve beyond it).
class PositionCache {
 public:
  const int* get(const Args& args, const char* const* names, size_t n, bool returns) {
    const size_t used = used_.load(std::memory_order_acquire);
    for (size_t i = 0; i < used; ++i) {
      if (slots_[i].schema == &args.schema()) return slots_[i].positions;
    }
    return add(args, names, n, returns);
  }

 private:
  const int* add(const Args& args, const char* const* names, size_t n, bool returns);
  struct Slot {
    const c10::FunctionSchema* schema;
    const int* positions;
  };
  static constexpr size_t kSlots = 16;
  Slot slots_[kSlots] = {};
  std::atomic<size_t> used_{0};  // slots_[i] for i < used_ are written (release/acquire)
  std::mutex mutex_;
};

// A call of an op from C++ (an autograd kernel calling its forward and backward ops): arguments set by name, or all
// of them passed on from a public op whose `_forward` op takes the same list; results read by name.
class Call {
 public:
  explicit Call(c10::OperatorHandle op) : op_(std::move(op)), stack_(op_.schema().arguments().size()) {}
  Call(c10::OperatorHandle op, std::vector<c10::IValue> args) : op_(std::move(op)), stack_(std::move(args)) {}
  Call& set(const char* name, c10::IValue value);
  Call& run();
  at::Tensor result(const char* name) const;

 private:
  c10::OperatorHandle op_;
  torch::jit::Stack stack_;
};

// Copies one argument into a field of its C++ type (the arguments stay whole: see arguments()).
inline void take(c10::IValue& v, at::Tensor& out) { out = v.toTensor(); }
inline void take(c10::IValue& v, OptTensor& out) { out = v.isNone() ? OptTensor() : OptTensor(v.toTensor()); }
inline void take(c10::IValue& v, OptTensorOut& out) {
  out = v.isNone() ? OptTensor() : OptTensor(v.toTensor());
}
inline void take(c10::IValue& v, double& out) { out = v.toDouble(); }
inline void take(c10::IValue& v, OptDouble& out) { out = v.isNone() ? OptDouble() : OptDouble(v.toDouble()); }
inline void take(c10::IValue& v, int64_t& out) { out = v.toInt(); }
inline void take(c10::IValue& v, OptInt& out) { out = v.isNone() ? OptInt() : OptInt(v.toInt()); }
inline void take(c10::IValue& v, bool& out) { out = v.toBool(); }
inline void take(c10::IValue& v, OptBool& out) { out = v.isNone() ? OptBool() : OptBool(v.toBool()); }
inline void take(c10::IValue& v, std::string& out) { out = v.toStringRef(); }
inline void take(c10::IValue& v, OptString& out) { out = v.isNone() ? OptString() : OptString(v.toStringRef()); }
inline void take(c10::IValue& v, OptDoubles& out) {
  out = v.isNone() ? OptDoubles() : OptDoubles(v.toDoubleVector());
}
inline void take(c10::IValue& v, OutputMask& out) {
  const auto list = v.toBoolList();
  for (size_t i = 0; i < out.size(); ++i) out[i] = list.get(i);
}

// A group read from an op whose schema lacks one of its names: a registration error, reported as such.
[[noreturn]] void missing_argument(const Args& args, const char* name);

}  // namespace schema
}  // namespace rl_losses

#define RL_LOSSES_GROUP_FIELD(type, name, dflt) type name{};
#define RL_LOSSES_GROUP_NAME(type, name, dflt) #name,
#define RL_LOSSES_GROUP_ENTRY(type, name, dflt) {::rl_losses::schema::SchemaType<type>::text, #name, #dflt},
#define RL_LOSSES_GROUP_READ(type, name, dflt)                                \
  if (*pos < 0) ::rl_losses::schema::missing_argument(args, #name);         \
  ::rl_losses::schema::take(args.arg(*pos++), name);
#define RL_LOSSES_GROUP_WRITE(type, name, dflt) \
  if (name.defined()) args.set_result(*pos, name); \
  ++pos;

// The schema entries of a list, for registration.cpp.
#define RL_LOSSES_ENTRIES(LIST) (::rl_losses::schema::Entries{LIST(RL_LOSSES_GROUP_ENTRY)})

// A group of arguments: RL_LOSSES_ARG_GROUP(PolicyArgs, RL_LOSSES_POLICY_ARGS) declares `struct PolicyArgs` with
// one field per entry and `read(Args&)`, which fills them by name.
#define RL_LOSSES_ARG_GROUP(Struct, LIST)                                                            \
  struct Struct {                                                                                    \
    LIST(RL_LOSSES_GROUP_FIELD)                                                                      \
    static constexpr const char* kNames[] = {LIST(RL_LOSSES_GROUP_NAME)};                            \
    void read(::rl_losses::schema::Args& args) {                                                     \
      static ::rl_losses::schema::PositionCache cache;                                               \
      const int* pos = cache.get(args, kNames, std::size(kNames), false);                            \
      LIST(RL_LOSSES_GROUP_READ)                                                                     \
    }                                                                                                \
  };

// A group of results (tensors): `write(Args&)` sets each defined field as the result of its name.
#define RL_LOSSES_RESULT_GROUP(Struct, LIST)                                                         \
  struct Struct {                                                                                    \
    LIST(RL_LOSSES_GROUP_FIELD)                                                                      \
    static constexpr const char* kNames[] = {LIST(RL_LOSSES_GROUP_NAME)};                            \
    void write(::rl_losses::schema::Args& args) const {                                              \
      static ::rl_losses::schema::PositionCache cache;                                               \
      const int* pos = cache.get(args, kNames, std::size(kNames), true);                             \
      LIST(RL_LOSSES_GROUP_WRITE)                                                                    \
    }                                                                                                \
  };
