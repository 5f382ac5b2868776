// The yardstick: the fastest device plugin we know how to write in Go, a floor for the race of
// issue 26 on the same machine (the e2e's yardstick variant; nox -s bench's restarts).
// It does what the Python plugin does on a kubelet restart and nothing else: an inotify watch
// on the socket directory, and at each new kubelet.sock a fresh socket of its own and Register
// at once, retried every 5 ms while kubelet refuses. It answers like the Python plugin
// (16 shares of /dev/sev-guest, /var/run/pcc mounted) so that the race's consumers run.
// It logs, in klog's format, the lines the e2e reads the plugin's legs from (tools/e2e/legs.py),
// in the Python plugin's words and at the same steps.
package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	api "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

const (
	kubeletSocket = "kubelet.sock"
	endpoint      = "pcc-yardstick.sock"
	registerRetry = 5 * time.Millisecond
	registerFor   = 10 * time.Second
)

type plugin struct {
	api.UnimplementedDevicePluginServer
	devices []*api.Device
}

// logf writes one line as klog does: severity, month and day, time of day to the microsecond.
func logf(format string, args ...any) {
	stamp := time.Now().Format("0102 15:04:05.000000")
	fmt.Fprintf(os.Stderr, "I%s %7d main.go:0] %s\n", stamp, os.Getpid(), fmt.Sprintf(format, args...))
}

// Only kubelet calls the yardstick, so every call is kubelet's.
func (p *plugin) GetDevicePluginOptions(context.Context, *api.Empty) (*api.DevicePluginOptions, error) {
	logf("Kubelet dialled in")
	return &api.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *api.Empty, stream grpc.ServerStreamingServer[api.ListAndWatchResponse]) error {
	logf("ListAndWatch stream opened on kubelet's connection (kubelet's)")
	if err := stream.Send(&api.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	<-stream.Context().Done()
	return nil
}

func (p *plugin) Allocate(_ context.Context, request *api.AllocateRequest) (*api.AllocateResponse, error) {
	response := &api.AllocateResponse{}
	for range request.ContainerRequests {
		response.ContainerResponses = append(response.ContainerResponses, &api.ContainerAllocateResponse{
			Devices: []*api.DeviceSpec{{ContainerPath: "/dev/sev-guest", HostPath: "/dev/sev-guest", Permissions: "rw"}},
			Mounts:  []*api.Mount{{ContainerPath: "/var/run/pcc", HostPath: "/var/run/pcc"}},
		})
	}
	return response, nil
}

// serve starts a new gRPC server on the plugin's socket, replacing whatever was there.
func (p *plugin) serve(dir string) (*grpc.Server, error) {
	path := filepath.Join(dir, endpoint)
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	listener, err := net.Listen("unix", path)
	if err != nil {
		return nil, err
	}
	server := grpc.NewServer()
	api.RegisterDevicePluginServer(server, p)
	go server.Serve(listener)
	return server, nil
}

func register(ctx context.Context, dir, resource string) {
	deadline := time.Now().Add(registerFor)
	for attempt := 1; ; attempt++ {
		logf("Registering %s at %s with endpoint %s", resource, filepath.Join(dir, kubeletSocket), endpoint)
		err := registerOnce(ctx, dir, resource)
		if err == nil {
			logf("Registered device plugin with Kubelet (attempt %d)", attempt)
			return
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			logf("Register: %v; waiting for the next kubelet.sock", err)
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(registerRetry):
		}
	}
}

func registerOnce(ctx context.Context, dir, resource string) error {
	connection, err := grpc.NewClient("unix://"+filepath.Join(dir, kubeletSocket),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer connection.Close()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	_, err = api.NewRegistrationClient(connection).Register(ctx, &api.RegisterRequest{
		Version: api.Version, Endpoint: endpoint, ResourceName: resource,
	})
	return err
}

// kubeletSockets sends a value each time kubelet.sock is created in dir.
func kubeletSockets(dir string) (<-chan struct{}, error) {
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC)
	if err != nil {
		return nil, err
	}
	if _, err := unix.InotifyAddWatch(fd, dir, unix.IN_CREATE); err != nil {
		return nil, err
	}
	created := make(chan struct{}, 1)
	go func() {
		buffer := make([]byte, 64*(unix.SizeofInotifyEvent+unix.NAME_MAX+1))
		for {
			n, err := unix.Read(fd, buffer)
			if err != nil {
				if err == unix.EINTR {
					continue
				}
				log.Fatalf("inotify: %v", err)
			}
			for offset := 0; offset < n; {
				event := (*unix.InotifyEvent)(unsafe.Pointer(&buffer[offset]))
				name := string(bytes.TrimRight(buffer[offset+unix.SizeofInotifyEvent:offset+unix.SizeofInotifyEvent+int(event.Len)], "\x00"))
				offset += unix.SizeofInotifyEvent + int(event.Len)
				if name == kubeletSocket {
					logf("inotify: %s created, restarting.", filepath.Join(dir, name))
					select {
					case created <- struct{}{}:
					default: // one pending restart covers any number of sockets
					}
				}
			}
		}
	}()
	return created, nil
}

func main() {
	dir := flag.String("dir", api.DevicePluginPath, "kubelet's device-plugin socket directory")
	resource := flag.String("resource", "tke.cloud.tencent.com/pcc-device", "extended resource name")
	count := flag.Int("count", 16, "devices advertised")
	flag.Parse()
	p := &plugin{}
	for i := 0; i < *count; i++ {
		p.devices = append(p.devices, &api.Device{ID: fmt.Sprintf("yardstick-%d", i), Health: api.Healthy})
	}
	created, err := kubeletSockets(*dir)
	if err != nil {
		log.Fatalf("watching %s: %v", *dir, err)
	}
	stopping, _ := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	for {
		server, err := p.serve(*dir)
		if err != nil {
			log.Fatalf("serving %s: %v", endpoint, err)
		}
		ctx, cancel := context.WithCancel(stopping)
		go register(ctx, *dir, *resource)
		select {
		case <-created:
			cancel()
			server.Stop()
		case <-stopping.Done():
			cancel()
			server.Stop()
			os.Remove(filepath.Join(*dir, endpoint))
			return
		}
	}
}
