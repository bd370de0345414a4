import rpcmp
from bench_models import SGD, mlp, mse

job = rpcmp.Job(model=mlp, stages=rpcmp.Split([8, 8]), placement=["worker1/cpu", "master/cpu"],
                batch_size=256, microbatches=4, optimizer=SGD, loss=mse, threads=1)
