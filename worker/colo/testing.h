// Test support: runs one thread per rank of a mesh over real Gloo on loopback.
#ifndef COLOD_WORKER_COLO_TESTING_H_
#define COLOD_WORKER_COLO_TESTING_H_

#include <functional>

#include "spec/mesh.h"
#include "worker/colo/process_group.h"
#include "worker/comm/instrumented_communicator.h"
#include "worker/tensor/tensor.h"

namespace colod::testing {

// Runs body(rank, pg) on every rank of `mesh` at once and joins them; the
// process groups (and their Gloo contexts) outlive every rank. With
// `instrument`, each communicator is an InstrumentedCommunicator (see Stats).
void RunMesh(const DeviceMesh& mesh, const std::function<void(int rank, ProcessGroup& pg)>& body,
             bool instrument = false);

// RunMesh over NCCL: rank r on CUDA device r, every axis made before `body`
// (the CUDA emulation in CI; fails the test without CUDA or devices).
void RunCudaMesh(const DeviceMesh& mesh, const std::function<void(int rank, ProcessGroup& pg)>& body);

// The collective counts of this rank's group along `axis` (RunMesh with
// instrument = true).
InstrumentedCommunicator::OpStats Stats(ProcessGroup& pg, const std::string& axis, const std::string& op);

// Element by element, |got - want| <= tol + tol * |want| (and equal shapes),
// reporting `what` and the first index that is not.
void ExpectAllClose(const Tensor& got, const Tensor& want, const std::string& what, double tol);

// The mesh of tp x dp in 1D mode.
DeviceMesh TpDpMesh(int tp, int dp = 1);

}  // namespace colod::testing

#endif  // COLOD_WORKER_COLO_TESTING_H_
