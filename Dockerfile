# One image for every service (API, workers, sweeper, migration). The base's torch (CUDA
# build, which also runs on CPU) satisfies transformers >= 5 (torch >= 2.6); the API never
# imports it. Build once: `docker compose build`.
FROM pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY src ./src
COPY migrations ./migrations
# torch is already in the image and the extra's range accepts it, so pip keeps it.
RUN pip install --no-cache-dir -e '.[worker]' \
 && python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
ENV BATCHWRIGHT_HOME=/data
RUN mkdir -p /data
EXPOSE 8000 9100
CMD ["batchwright", "serve", "--host", "0.0.0.0", "--port", "8000"]
