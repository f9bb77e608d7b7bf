"""TensorRT's side of the exporter: the trt flavour's static checks (`lint`, `specexport check-trt`), the engine
build (`build`), and the tree acceptance kernel (`accept`) with its plugin (`plugin`)."""
