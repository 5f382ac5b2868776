"""The DRA mode (`--mode=dra`): the same daemon as a Dynamic Resource Allocation driver.

Its tasks are in the one nursery tree drawn at the top of pcc_plugin/supervisor.py. kubelet
finds the registration socket in plugins_registry, asks it what it is (GetInfo: a DRAPlugin,
this driver, the DRA socket) and dials the DRA socket. The scheduler allocates the devices
the ResourceSlices list (`slices`); kubelet then asks the driver to prepare each claim
(`claims.Preparer`): a CDI spec per claim, checkpointed on disk. Imported only in this mode:
the API client (`kube`) costs memory the device-plugin mode does not pay. docs/dra.md is the
operator's view.
"""
