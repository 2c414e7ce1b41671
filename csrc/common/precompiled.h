// The torch headers nearly every C++ file includes, precompiled once per build (setup.py, PrecompiledHeaderBuild):
// parsing them took ~20 s of CPU per file, most of a CPU-only build's time. Included by the build through
// -include, never by a source file; each file still includes what it uses.
//
// Not torch/autograd.h, which only the three autograd files include: GCC instantiates the templates that the
// header's inline functions use at the end of every file compiled with the precompiled header (the header stores
// them as pending), and with autograd.h that was 8 s of CPU per file, even for an empty one; without it, 3 s.
//
// Not the ATen/ATen.h umbrella either, which declares every ATen op (its ATen/Functions.h): the tensor, the
// dispatch macros, parallel_for, the registration API and the few ops the headers under csrc/ call (each file
// includes the ATen/ops/ headers of the others it calls). Precompiling it took 19.7 CPU-s against 26.7 for the
// umbrella header; a file compiled with either took as long (benchmarks/results/cpu-2026-11-27-build-tus.txt).
// No header that a file with CPU loops includes may include ATen/ATen.h: that file would parse the rest of it.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
