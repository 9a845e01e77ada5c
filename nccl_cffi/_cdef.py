"""The subset of ``nccl.h`` (and five calls of ``cuda.h``, and NCCL M2N's
``nccl_m2n.h``) this binding declares.

Declared by hand rather than parsed from a header so that installing needs no
CUDA toolkit. Only types whose layout NCCL has kept stable since 2.14 appear
here; ``ncclConfig_t`` is the 2.14 prefix of the struct, which NCCL reads by
its ``size`` field and completes with defaults (see ``comm.py``).
"""

CDEF = """
typedef struct ncclComm* ncclComm_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef void* cudaStream_t;

typedef enum {
  ncclSuccess = 0, ncclUnhandledCudaError = 1, ncclSystemError = 2,
  ncclInternalError = 3, ncclInvalidArgument = 4, ncclInvalidUsage = 5,
  ncclRemoteError = 6, ncclInProgress = 7, ncclTimeout = 8
} ncclResult_t;

typedef int ncclDataType_t;
typedef int ncclRedOp_t;

typedef struct {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char *netName;
  int splitShare;
} ncclConfig_t;

ncclResult_t ncclGetVersion(int *version);
ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId);
const char* ncclGetErrorString(ncclResult_t result);
const char* ncclGetLastError(ncclComm_t comm);

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId,
                                    int rank, ncclConfig_t *config);
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);
ncclResult_t ncclCommCount(const ncclComm_t comm, int *count);
ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank);

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm,
                           cudaStream_t stream);
ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream);
ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype,
                      int peer, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype,
                      int peer, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);

/* libcuda (the driver API), for the calls a push makes per tensor or chunk */
int cuMemcpyDtoDAsync_v2(unsigned long long dst, unsigned long long src, size_t n, void *s);
int cuEventRecord(void *event, void *stream);
int cuEventQuery(void *event);
int cuStreamWaitEvent(void *stream, void *event, unsigned int flags);
int cuEventElapsedTime(float *ms, void *start, void *end);

typedef struct { int32_t device_type; int32_t device_id; } DLDevice;
typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } DLDataType;
typedef struct {
  void *data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t *shape;
  int64_t *strides;
  uint64_t byte_offset;
} DLTensor;
typedef struct { DLTensor dl_tensor; void *manager_ctx; void (*deleter)(void *); } DLManagedTensor;
typedef struct { uint32_t major; uint32_t minor; } DLPackVersion;
typedef struct {
  DLPackVersion version; void *manager_ctx; void (*deleter)(void *);
  uint64_t flags; DLTensor dl_tensor;
} DLManagedTensorVersioned;

/* NCCL M2N (libnccl_m2n of nccl-extensions; nccl_m2n.h, NCCL_M2N_API_VERSION 2) */
typedef struct {
  size_t size; unsigned int version; int ndims; int *dims; int startRank;
} ncclMesh_t;
typedef struct {
  size_t size; unsigned int version; void *dataPtr; size_t *localShape; int ndims;
  ncclDataType_t dtype; const ncclMesh_t *mesh; int *placements;
} ncclDistTensor_t;
typedef struct {
  size_t size; unsigned int magic; unsigned int version; int maxCta;
} ncclM2nConfig_t;
typedef struct ncclM2nHandle* ncclM2nHandle_t;
ncclResult_t ncclM2nInit(ncclM2nHandle_t *handle, const ncclM2nConfig_t *config);
ncclResult_t ncclM2nFinalize(ncclM2nHandle_t handle);
const char* ncclM2nGetLastError(void);
ncclResult_t ncclReshard(ncclM2nHandle_t handle, ncclComm_t comm, const ncclDistTensor_t *src,
                         const ncclDistTensor_t *dst, cudaStream_t stream);
"""
