// The torch headers nearly every C++ file includes, precompiled once per build (setup.py, PrecompiledHeaderBuild):
// parsing them took ~20 s of CPU per file, most of a CPU-only build's time. Included by the build through
// -include, never by a source file; each file still includes what it uses.
//
// Not torch/autograd.h, which only the three autograd files include: GCC instantiates the templates that the
// header's inline functions use at the end of every file compiled with the precompiled header (the header stores
// them as pending), and with autograd.h that was 8 s of CPU per file, even for an empty one; without it, 3 s.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
