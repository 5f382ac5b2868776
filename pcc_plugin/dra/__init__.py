"""The DRA mode (`--mode=dra`): the same daemon as a Dynamic Resource Allocation driver.

    driver.serve                        the mode's nursery (supervisor.serve starts it)
    ├── health.watch_health             inotify on the device's and mounts' parents
    ├── slices.publish                  the node's ResourceSlices, kept by list and watch
    └── driver.serve_kubelet            one generation of sockets after another
        └── generation nursery
            ├── grpc_server.serve       the DRA socket (NodePrepare/NodeUnprepareResources)
            ├── grpc_server.serve       then the registration socket kubelet dials
            └── driver.watch_sockets    either socket gone: serve again

kubelet finds the registration socket in plugins_registry, asks it what it is (GetInfo:
a DRAPlugin, this driver, the DRA socket) and dials the DRA socket. The scheduler
allocates the devices the slices list; kubelet then asks the driver to prepare each
claim (claims.Preparer): a CDI spec per claim, checkpointed on disk. Imported only in
this mode: the API client costs memory the device-plugin mode does not pay.
"""
