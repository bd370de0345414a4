import rpcmp
from bench_models import SGD, bce, unet

job = rpcmp.Job(model=unet, stages=["encoder", "decoder", "segmentation_head"], batch_size=16,
                microbatches=4, batchnorm="micro", optimizer=SGD, loss=bce, threads=1)
