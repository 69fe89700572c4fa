"""What the drills and the tests share: prompts and keyed content (`prompts`, `keyed`),
small worlds for engine tests (`worlds`), damage to LMDB (`damage`), throwaway
certificates (`certs`), a servicer context (`context`), the worker processes the drills
start (`crash_worker`, `soak_worker`) and the drills themselves (`crash`, `soak`, `fuzz`,
`publish`). Tests import from here and benchmarks/ are thin command lines over it; neither
imports the other.
"""
