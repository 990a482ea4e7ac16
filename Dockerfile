# One image for every service (API, workers, sweeper, migration). The base's torch (CUDA
# build, which also runs on CPU) is the worker extra's floor, 2.12: the first whose
# varlen_attn takes a paged KV cache (seqused_k, block_table), which the engine's CUDA
# path calls. CUDA 12.6 runs on drivers from R560 (a CUDA 13.0 image needs R580). The API
# never imports torch. Build once: `docker compose build`.
FROM pytorch/pytorch:2.12.0-cuda12.6-cudnn9-runtime
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY src ./src
COPY migrations ./migrations
# torch is already in the image and the extra's range accepts it, so pip keeps it.
# The build fails here, not at a worker's first step, if the base's varlen_attn lacks an
# argument the engine passes.
RUN pip install --no-cache-dir -e '.[worker]' \
 && python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
 && python -c "from batchwright.engine.backends import varlen_missing as m; assert not m(), m()"
ENV BATCHWRIGHT_HOME=/data
RUN mkdir -p /data
EXPOSE 8000 9100
CMD ["batchwright", "serve", "--host", "0.0.0.0", "--port", "8000"]
