"""The bench's split Unet cut inside its encoder with SplitAt: three of the encoder's feature maps
go from stage 0 to the decoder's stage (the skip connections cross a stage)."""
import rpcmp
from bench_models import SGD, bce, unet

job = rpcmp.Job(model=unet, stages=rpcmp.SplitAt("encoder.layer3", "decoder"), batch_size=16,
                microbatches=4, batchnorm="micro", optimizer=SGD, loss=bce, threads=1)
