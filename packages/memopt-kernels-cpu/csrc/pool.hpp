// The persistent thread pool and the static work partition of memopt-kernels-cpu.
//
// Threads are std::threads created lazily at the first parallel run and kept until the thread
// count changes. A run splits its work into at most get_num_threads() contiguous parts and
// part p always runs on pool thread p: with the same tensors, chunk size and thread count, a
// given range of memory is touched by the same thread at every step (and by first_touch, which
// uses the same rule), so on a NUMA host its pages stay on that thread's node (first-touch
// placement). A fused step lets a thread that finished its part take chunks of a part that is
// behind (run_step), so only an unbalanced step touches memory from another thread. The OS may
// still migrate threads; pin them (taskset, numactl) for strict locality.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "memopt_cpu/kernel_api.hpp"

namespace memopt_cpu {

// CPUs this process may run on (sched_getaffinity), at least 1.
int default_num_threads();
// Threads of the pool (1: everything runs in the caller's thread). n >= 1.
void set_num_threads(int n);
int get_num_threads();
// Elements per chunk of a fused step (a positive multiple of 32); default 65536.
void set_chunk_size(int64_t n);
int64_t get_chunk_size();

// Runs fn(part) for every part in [0, n_parts) and waits. Part p runs on pool thread p (in the
// caller when n_parts == 1 or the pool has one thread); parts beyond the thread count, possible
// when another thread resized the pool meanwhile, stride over the threads. The first exception
// of any part is rethrown here after every part has finished.
void parallel_run(int n_parts, const std::function<void(int)>& fn);

// Splits [0, n) into contiguous ranges whose boundaries are multiples of 32 (the last one ends
// at n), at most one per thread and none shorter than a chunk, and runs fn(begin, end) on each.
void parallel_blocks(int64_t n, const std::function<void(int64_t, int64_t)>& fn);

// A chunk of a fused step: elements [begin, end) of slot row `row`.
struct StepChunk {
  int64_t row, begin, end;
};
// How run_step cuts and splits a step over slots of the given padded sizes for `threads`
// threads: its chunks, and first[p], the index of part p's first chunk (first.size() - 1 parts,
// first.back() == chunks.size(); both empty for a step without elements).
struct StepPartition {
  std::vector<StepChunk> chunks;
  std::vector<std::size_t> first;
};
StepPartition partition_step(const int64_t* padded, int64_t n_rows, int64_t chunk_size,
                             int threads);

// One fused step over a slot table: each slot's padded range [0, padded) is cut into chunks of
// get_chunk_size() elements (never crossing a slot); the chunks, in table order, are split into
// contiguous parts balanced by element count (a chunk goes to the part holding its midpoint),
// one per thread but at most one per get_chunk_size() elements of the whole step (a single part
// runs in the calling thread; partition_step gives the split). Thread p calls
// kernels.step_range on part p's chunks in order, then helps with the untaken chunks of the
// parts still running (work stealing: a preempted thread does not hold up the step). The
// results do not depend on which thread runs a chunk. Row r runs with cfgs[row_cfg[r]], or with
// cfgs[0] when row_cfg is null (rows of parameters at several step counts share a call).
void run_step(const IsaKernels& kernels, const StepConfig* cfgs, const int32_t* row_cfg,
              const SlotRow* rows, int64_t n_rows);

// Zero-fills [addr, addr + nbytes) with the same static partition: nbytes split evenly over the
// threads at page (4096-byte) boundaries, part p written by pool thread p.
void first_touch(void* addr, std::size_t nbytes);

}  // namespace memopt_cpu
