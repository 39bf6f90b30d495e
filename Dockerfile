# titan-train image: build in one stage, run from a slim CUDA runtime stage with the same
# pinned LibTorch. Versions come from scripts/versions.env, the list scripts/setup.sh uses
# (test/app/test_packaging.cpp checks that nothing here pins a version of its own).
#   docker build -t titan-train .
#   docker run --gpus all titan-train --config configs/llama3_debug.toml
#   docker run --gpus all --entrypoint torchrun titan-train --nproc_per_node 8 --no-python titan-train ...
ARG CUDA_IMAGE_TAG=13.0.2
FROM nvidia/cuda:${CUDA_IMAGE_TAG}-cudnn-devel-ubuntu24.04 AS build
COPY scripts/versions.env /opt/titan/versions.env
RUN . /opt/titan/versions.env && apt-get update && DEBIAN_FRONTEND=noninteractive \
    apt-get install -y --no-install-recommends $DEBIAN_BUILD_PACKAGES && rm -rf /var/lib/apt/lists/*
# pyarrow: its wheel's Arrow C++ libraries give titan-train Parquet input (linked from here).
RUN . /opt/titan/versions.env && python3 -m venv /opt/venv && \
    /opt/venv/bin/pip install --no-cache-dir torch==$TORCH_VERSION pyarrow==$PYARROW_VERSION && \
    /opt/venv/bin/pip install --no-cache-dir --no-deps nvidia-cutlass==$CUTLASS_VERSION
COPY . /src
WORKDIR /src
RUN cmake -S . -B /build -G Ninja -DTITAN_PYTHON=/opt/venv/bin/python -DTITAN_BUILD_TESTS=OFF \
      -DCMAKE_CUDA_ARCHITECTURES="80;90" && cmake --build /build

FROM nvidia/cuda:${CUDA_IMAGE_TAG}-cudnn-runtime-ubuntu24.04
COPY scripts/versions.env /opt/titan/versions.env
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv libpcre2-8-0 && rm -rf /var/lib/apt/lists/*
RUN . /opt/titan/versions.env && python3 -m venv /opt/venv && \
    /opt/venv/bin/pip install --no-cache-dir torch==$TORCH_VERSION pyarrow==$PYARROW_VERSION
COPY --from=build /build/titan-train /usr/local/bin/titan-train
COPY configs /opt/titan/configs
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /opt/titan
ENTRYPOINT ["titan-train"]
