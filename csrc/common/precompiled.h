// The torch headers nearly every C++ file includes, precompiled once per build (setup.py, PrecompiledHeaderBuild):
// parsing them took ~20 s of CPU per file, most of a CPU-only build's time. Included by the build through
// -include, never by a source file; each file still includes what it uses.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/library.h>
