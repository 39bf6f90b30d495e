// DualPipeV's overlapped forward + backward pairs (docs/distributed.md, "Expert all-to-all
// overlap"): the forward of one micro-batch and the backward of another, on two stages of
// one rank, run on two threads that take turns. Exactly one of them runs at any time, and
// the turn passes at each expert all-to-all after the collective is started and before it
// is waited for, so one half's exchange is in flight while the other half computes.
//
// Every rank of a stage runs the same actions over the same layers, so the turns fall at the
// same points on all of them and each group's collectives are started in the same order on
// every member, as c10d requires. Only one half runs at a time, so the two share the
// runner's state without locks, and the numbers are those of running the halves one after
// the other (the turns move work in time, never reorder a sum).
#pragma once

#include <cstdint>
#include <functional>

namespace titan {

// Runs `forward` on this thread and `backward` on a new thread (which gets this thread's
// ATen thread-local state, grad mode and dispatch keys, and on a GPU its current device and
// stream), forward first, taking turns as above;
// returns once both have ended, with the number of times the turn passed. When one half
// ends (or throws), the other runs on alone. An exception is rethrown here after both
// ended, the forward's first. Pairs do not nest.
int64_t run_overlapped_pair(const std::function<void()>& forward,
                            const std::function<void()>& backward);

// Called by a collective between its start and its wait. Inside a pair, it hands the turn
// to the other half (unless that half has ended) and returns when the turn comes back;
// outside a pair it returns at once. The caller's half is its thread: the pair's forward
// thread is the forward, and any other thread (the backward's, or an autograd device
// thread working for it) is the backward.
void overlap_turn();

}  // namespace titan
