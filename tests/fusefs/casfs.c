/*
 * casfs: a passthrough FUSE filesystem for casstore's tests that can lie the
 * way NFS, Lustre and FUSE filesystems do in the field (issue 17).
 *
 *   casfs MODE BACKING_DIR MOUNTPOINT [fuse options...]
 *
 * MODE is one of
 *   local            honest passthrough; flock/fcntl locks are left to the
 *                    kernel (we register no lock handlers, so fs/fuse sets
 *                    fc->no_flock / fc->no_lock and locks are kernel-local).
 *   grant            every flock and POSIX lock request is granted to
 *                    everyone (F_GETLK says "unlocked"): no exclusion at all,
 *                    like NFS/FUSE setups whose locks silently succeed.
 *   enosys           flock and POSIX locks fail with ENOSYS, like Lustre
 *                    mounted without -o flock.  fs/fuse only falls back to
 *                    local locks when the daemon does not *offer* lock
 *                    handlers at INIT (no FUSE_POSIX_LOCKS / FUSE_FLOCK_LOCKS
 *                    flag); an ENOSYS answer to a FUSE_SETLK/FUSE_GETLK
 *                    request is handed to the caller unchanged (the test
 *                    tests/test_fs_lying.py checks that it is), so ENOSYS it is.
 *   delay_rename=MS  locks are kernel-local, but a rename that replaces a file
 *                    is not atomic: the target disappears at once, the rename
 *                    returns, and the new file appears under the name MS
 *                    milliseconds later (renames run in order); an fsync of
 *                    any directory waits until every pending rename has landed.
 *                    A process that looks the name up meanwhile gets ENOENT,
 *                    as lock-free readers did on a bindfs passthrough (issue
 *                    17).  Why not "unlink, sleep, rename" inside the rename
 *                    request: nobody could see it.  The kernel holds the
 *                    directory's lock for the whole request (a failed
 *                    revalidation falls back to a lookup that waits for it)
 *                    and libfuse's high-level layer write-locks both nodes
 *                    (an open of the old target waits too), so a window
 *                    inside the request is invisible; it has to outlast it.
 *                    Renames to a new name (objects put in place) are atomic.
 *                    The moved file waits in BACKING.pending/ meanwhile.
 *
 * The daemon watches its stdin: when it reads EOF (the test session that
 * started it exited, however it died) it detaches the mount itself, so a
 * crashed session never leaves a stale mount behind.
 *
 * Built against libfuse3's high-level API, multithreaded; every operation on
 * an open file goes through the file's descriptor (nullpath_ok), files
 * unlinked or replaced while open are kept out of sight (see HIDDEN_PREFIX),
 * so they keep working and no .fuse_hidden files show in directories.
 */

#define FUSE_USE_VERSION 31
#define _GNU_SOURCE

#include <fuse.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

enum mode { MODE_LOCAL, MODE_GRANT, MODE_ENOSYS, MODE_DELAY_RENAME };

static enum mode g_mode = MODE_LOCAL;
static long g_delay_ms = 0;
static int g_base = -1;           /* the backing directory; every path is resolved under it */
static char *g_mountpoint = NULL;

static void wait_for_renames(void);
static void transit_wait(const char *path);

/* libfuse's high-level layer keeps a file that is unlinked or renamed over while open
 * by renaming it to ".fuse_hidden<node><counter>" in its directory (hard_remove off):
 * without that, a node that lost its name answers ESTALE to path operations, and the
 * kernel sends fstat() of an open file as one (no file handle), so an fstat of a ref
 * replaced under a reader failed where the local disk succeeds.  We keep that, but
 * put hidden files in BACKING.hidden/ (the name is unique across directories), so no
 * listing shows them and no directory is kept from being removed. */
#define HIDDEN_PREFIX ".fuse_hidden"

static int g_hidden = -1;

static const char *base_name(const char *path)
{
	const char *slash = strrchr(path, '/');
	return slash ? slash + 1 : path;
}

static int is_hidden(const char *path)
{
	return path != NULL && strncmp(base_name(path), HIDDEN_PREFIX, strlen(HIDDEN_PREFIX)) == 0;
}

/* "/a/b" -> "a/b", "/" -> "." : relative to dfd(path) for the *at() calls. */
static const char *rel(const char *path)
{
	if (path == NULL || path[0] == '\0' || (path[0] == '/' && path[1] == '\0'))
		return ".";
	if (is_hidden(path))
		return base_name(path);
	return path[0] == '/' ? path + 1 : path;
}

static int dfd(const char *path)
{
	return is_hidden(path) ? g_hidden : g_base;
}

/* Files created for another user belong to that user (the daemon runs as root). */
static void give_to_caller(const char *p)
{
	struct fuse_context *ctx = fuse_get_context();
	if (ctx != NULL && (ctx->uid != 0 || ctx->gid != 0))
		(void) fchownat(g_base, p, ctx->uid, ctx->gid, AT_SYMLINK_NOFOLLOW);
}

static void *cf_init(struct fuse_conn_info *conn, struct fuse_config *cfg)
{
	(void) conn;
	cfg->use_ino = 1;       /* st_ino of the backing file: hard links are recognisable */
	cfg->nullpath_ok = 1;   /* operations on open files work after unlink/rename-over */
	cfg->hard_remove = 0;   /* open files that lose their name are hidden (see HIDDEN_PREFIX) */
	/* Honest modes: nothing cached, every lookup and stat reaches the backing directory. */
	cfg->entry_timeout = 0;
	cfg->attr_timeout = 0;
	cfg->negative_timeout = 0;
	return NULL;
}

static int cf_getattr(const char *path, struct stat *st, struct fuse_file_info *fi)
{
	if (fi == NULL)
		transit_wait(path);
	int res = fi ? fstat((int) fi->fh, st) : fstatat(dfd(path), rel(path), st, AT_SYMLINK_NOFOLLOW);
	return res == -1 ? -errno : 0;
}

static int cf_access(const char *path, int mask)
{
	transit_wait(path);
	return faccessat(dfd(path), rel(path), mask, 0) == -1 ? -errno : 0;
}

static int cf_readlink(const char *path, char *buf, size_t size)
{
	ssize_t n = readlinkat(dfd(path), rel(path), buf, size - 1);
	if (n == -1)
		return -errno;
	buf[n] = '\0';
	return 0;
}

struct dirh {
	DIR *dp;
	struct dirent *entry;
	off_t offset;
};

static int cf_opendir(const char *path, struct fuse_file_info *fi)
{
	int fd = openat(dfd(path), rel(path), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fd == -1)
		return -errno;
	struct dirh *d = calloc(1, sizeof(*d));
	if (d == NULL) {
		close(fd);
		return -ENOMEM;
	}
	d->dp = fdopendir(fd);
	if (d->dp == NULL) {
		int err = errno;
		close(fd);
		free(d);
		return -err;
	}
	fi->fh = (uint64_t) (uintptr_t) d;
	return 0;
}

static int cf_readdir(const char *path, void *buf, fuse_fill_dir_t filler, off_t offset,
		      struct fuse_file_info *fi, enum fuse_readdir_flags flags)
{
	struct dirh *d = (struct dirh *) (uintptr_t) fi->fh;
	(void) path;
	(void) flags;
	if (offset != d->offset) {
		seekdir(d->dp, offset);
		d->entry = NULL;
		d->offset = offset;
	}
	for (;;) {
		if (d->entry == NULL) {
			d->entry = readdir(d->dp);
			if (d->entry == NULL)
				break;
		}
		struct stat st;
		memset(&st, 0, sizeof(st));
		st.st_ino = d->entry->d_ino;
		st.st_mode = (mode_t) d->entry->d_type << 12;
		off_t next = telldir(d->dp);
		if (filler(buf, d->entry->d_name, &st, next, 0))
			break;
		d->entry = NULL;
		d->offset = next;
	}
	return 0;
}

static int cf_releasedir(const char *path, struct fuse_file_info *fi)
{
	struct dirh *d = (struct dirh *) (uintptr_t) fi->fh;
	(void) path;
	closedir(d->dp);
	free(d);
	return 0;
}

static int cf_fsyncdir(const char *path, int datasync, struct fuse_file_info *fi)
{
	struct dirh *d = (struct dirh *) (uintptr_t) fi->fh;
	(void) path;
	/* One line per call in daemon.log: tests count the fsyncs that reached the daemon (issue 17). */
	fprintf(stderr, "casfs: FSYNCDIR\n");
	wait_for_renames();
	int fd = dirfd(d->dp);
	return (datasync ? fdatasync(fd) : fsync(fd)) == -1 ? -errno : 0;
}

static int cf_mknod(const char *path, mode_t mode, dev_t rdev)
{
	if (mknodat(dfd(path), rel(path), mode, rdev) == -1)
		return -errno;
	give_to_caller(rel(path));
	return 0;
}

static int cf_mkdir(const char *path, mode_t mode)
{
	if (mkdirat(dfd(path), rel(path), mode) == -1)
		return -errno;
	give_to_caller(rel(path));
	return 0;
}

static int cf_unlink(const char *path)
{
	/* libfuse removes a hidden file at its last close, but the kernel may still hold the
	 * inode from a lookup made before the rename (an open racing with it): opening that
	 * must give the old file, as on a local disk, not ENOENT.  Hidden files stay until
	 * the mount goes (the fixture removes BACKING.hidden then). */
	if (is_hidden(path))
		return 0;
	return unlinkat(dfd(path), rel(path), 0) == -1 ? -errno : 0;
}

static int cf_rmdir(const char *path)
{
	return unlinkat(dfd(path), rel(path), AT_REMOVEDIR) == -1 ? -errno : 0;
}

static int cf_symlink(const char *target, const char *path)
{
	if (symlinkat(target, dfd(path), rel(path)) == -1)
		return -errno;
	give_to_caller(rel(path));
	return 0;
}

/* delay_rename: the renames still to land, oldest first (one FIFO: a name never goes backwards). */
struct pending {
	struct pending *next;
	char name[32];          /* under g_pending */
	char *target;           /* relative to g_base */
	struct timespec due;    /* CLOCK_MONOTONIC */
};

static int g_pending = -1;
static struct pending *g_head = NULL, *g_tail = NULL;
static unsigned long g_counter = 0;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv;     /* CLOCK_MONOTONIC: signalled on enqueue and when one lands */

static void *land_renames(void *arg)
{
	(void) arg;
	pthread_mutex_lock(&g_mu);
	for (;;) {
		while (g_head == NULL)
			pthread_cond_wait(&g_cv, &g_mu);
		struct pending *p = g_head;
		if (pthread_cond_timedwait(&g_cv, &g_mu, &p->due) != ETIMEDOUT) {
			struct timespec now;
			clock_gettime(CLOCK_MONOTONIC, &now);
			if (now.tv_sec < p->due.tv_sec || (now.tv_sec == p->due.tv_sec && now.tv_nsec < p->due.tv_nsec))
				continue;
		}
		if (renameat(g_pending, p->name, g_base, p->target) == -1) {
			perror("casfs: landing a delayed rename");
			(void) unlinkat(g_pending, p->name, 0);
		}
		g_head = p->next;
		if (g_head == NULL)
			g_tail = NULL;
		free(p->target);
		free(p);
		pthread_cond_broadcast(&g_cv);
	}
	return NULL;
}

static int delayed_rename(const char *from, const char *to)
{
	struct pending *p = calloc(1, sizeof(*p));
	if (p == NULL || (p->target = strdup(to)) == NULL) {
		free(p);
		return -ENOMEM;
	}
	pthread_mutex_lock(&g_mu);
	snprintf(p->name, sizeof(p->name), "r%lu", g_counter++);
	/* The lie: the source leaves at once, the target goes at once, the new file comes later. */
	int err = 0;
	if (renameat(g_base, from, g_pending, p->name) == -1) {
		err = -errno;
	} else if (unlinkat(g_base, to, 0) == -1 && errno != ENOENT) {
		err = -errno;
		(void) renameat(g_pending, p->name, g_base, from);  /* put it back: the rename failed */
	}
	if (err) {
		pthread_mutex_unlock(&g_mu);
		free(p->target);
		free(p);
		return err;
	}
	clock_gettime(CLOCK_MONOTONIC, &p->due);
	p->due.tv_sec += g_delay_ms / 1000;
	p->due.tv_nsec += (g_delay_ms % 1000) * 1000000L;
	if (p->due.tv_nsec >= 1000000000L) {
		p->due.tv_sec++;
		p->due.tv_nsec -= 1000000000L;
	}
	if (g_tail)
		g_tail->next = p;
	else
		g_head = p;
	g_tail = p;
	pthread_cond_broadcast(&g_cv);
	pthread_mutex_unlock(&g_mu);
	return 0;
}

/* fsync of a directory: every rename still pending lands first (a durable writer sees its own). */
static void wait_for_renames(void)
{
	if (g_mode != MODE_DELAY_RENAME)
		return;
	pthread_mutex_lock(&g_mu);
	while (g_head != NULL)
		pthread_cond_wait(&g_cv, &g_mu);
	pthread_mutex_unlock(&g_mu);
}

/* The path libfuse just hid on this thread: it is about to rename another file over it. */
static __thread char *t_just_hidden = NULL;

/* Hiding opens a window: the open target has been moved aside and the new file is not
 * in place yet.  Lookups, stats and opens of that name from other threads would see it
 * missing -- the false "not found" lock-free readers met on bindfs, which hides the same
 * way -- so they wait until the rename that follows completes.  An unlink of an open
 * file hides too, with no rename after it: its waiters give up after TRANSIT_MS and see
 * the name gone, which it is. */
#define TRANSIT_MS 50
#define TRANSIT_MAX 64

struct transit {
	char path[PATH_MAX];
	pthread_t owner;
	struct timespec until;  /* CLOCK_MONOTONIC */
	int used;
};

static struct transit g_transit[TRANSIT_MAX];
static pthread_mutex_t g_tmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_tcv;   /* CLOCK_MONOTONIC */
static __thread int t_in_transit = 0;

static int before(const struct timespec *a, const struct timespec *b)
{
	return a->tv_sec < b->tv_sec || (a->tv_sec == b->tv_sec && a->tv_nsec < b->tv_nsec);
}

static void transit_begin(const char *p)
{
	struct timespec until;
	clock_gettime(CLOCK_MONOTONIC, &until);
	until.tv_nsec += TRANSIT_MS * 1000000L;
	if (until.tv_nsec >= 1000000000L) {
		until.tv_sec++;
		until.tv_nsec -= 1000000000L;
	}
	pthread_mutex_lock(&g_tmu);
	for (int i = 0; i < TRANSIT_MAX; i++) {
		struct timespec now;
		clock_gettime(CLOCK_MONOTONIC, &now);
		if (!g_transit[i].used || before(&g_transit[i].until, &now)) {
			snprintf(g_transit[i].path, sizeof(g_transit[i].path), "%s", p);
			g_transit[i].owner = pthread_self();
			g_transit[i].until = until;
			g_transit[i].used = 1;
			t_in_transit = 1;
			break;
		}
	}  /* table full: no wait for this one (64 hides in 50 ms do not happen in these tests) */
	pthread_mutex_unlock(&g_tmu);
}

static void transit_end(void)
{
	if (!t_in_transit)
		return;
	pthread_mutex_lock(&g_tmu);
	for (int i = 0; i < TRANSIT_MAX; i++)
		if (g_transit[i].used && pthread_equal(g_transit[i].owner, pthread_self()))
			g_transit[i].used = 0;
	t_in_transit = 0;
	pthread_cond_broadcast(&g_tcv);
	pthread_mutex_unlock(&g_tmu);
}

static void transit_wait(const char *path)
{
	transit_end();  /* a hide of ours with no rename after it (an unlink) is over by now */
	const char *p = rel(path);
	pthread_mutex_lock(&g_tmu);
	for (;;) {
		struct timespec now;
		clock_gettime(CLOCK_MONOTONIC, &now);
		const struct timespec *until = NULL;
		for (int i = 0; i < TRANSIT_MAX && until == NULL; i++)
			if (g_transit[i].used && before(&now, &g_transit[i].until) && strcmp(g_transit[i].path, p) == 0)
				until = &g_transit[i].until;
		if (until == NULL)
			break;
		struct timespec deadline = *until;
		pthread_cond_timedwait(&g_tcv, &g_tmu, &deadline);
	}
	pthread_mutex_unlock(&g_tmu);
}

static int rename_impl(const char *from, const char *to, unsigned int flags)
{
	if (is_hidden(to)) {  /* libfuse hides an open target (or unlinked file): out of sight at once */
		transit_end();
		transit_begin(rel(from));
		if (renameat(dfd(from), rel(from), g_hidden, rel(to)) == -1) {
			int err = errno;
			transit_end();
			return -err;
		}
		free(t_just_hidden);
		t_just_hidden = strdup(from);
		return 0;
	}
	int was_hidden = t_just_hidden != NULL && strcmp(t_just_hidden, to) == 0;
	free(t_just_hidden);
	t_just_hidden = NULL;
	if (g_mode == MODE_DELAY_RENAME && flags == 0 && was_hidden) {
		/* The target was open: libfuse moved it aside first, so this rename replaces it. */
		struct stat src;
		if (fstatat(dfd(from), rel(from), &src, AT_SYMLINK_NOFOLLOW) == 0 && !S_ISDIR(src.st_mode))
			return delayed_rename(rel(from), rel(to));
	}
	if (g_mode == MODE_DELAY_RENAME && flags == 0) {
		struct stat st, src;
		if (fstatat(dfd(to), rel(to), &st, AT_SYMLINK_NOFOLLOW) == 0 && !S_ISDIR(st.st_mode)) {
			if (fstatat(dfd(from), rel(from), &src, AT_SYMLINK_NOFOLLOW) == -1)
				return -errno;
			if (!S_ISDIR(src.st_mode) && (src.st_ino != st.st_ino || src.st_dev != st.st_dev))
				return delayed_rename(rel(from), rel(to));
		}
	}
	int res = flags ? renameat2(dfd(from), rel(from), dfd(to), rel(to), flags)
			: renameat(dfd(from), rel(from), dfd(to), rel(to));
	return res == -1 ? -errno : 0;
}

static int cf_rename(const char *from, const char *to, unsigned int flags)
{
	int res = rename_impl(from, to, flags);
	if (!is_hidden(to))
		transit_end();  /* the rename that follows a hide is done: the name is back */
	return res;
}

static int cf_link(const char *from, const char *to)
{
	return linkat(dfd(from), rel(from), dfd(to), rel(to), 0) == -1 ? -errno : 0;
}

static int cf_chmod(const char *path, mode_t mode, struct fuse_file_info *fi)
{
	int res = fi ? fchmod((int) fi->fh, mode) : fchmodat(dfd(path), rel(path), mode, 0);
	return res == -1 ? -errno : 0;
}

static int cf_chown(const char *path, uid_t uid, gid_t gid, struct fuse_file_info *fi)
{
	int res = fi ? fchown((int) fi->fh, uid, gid) : fchownat(dfd(path), rel(path), uid, gid, AT_SYMLINK_NOFOLLOW);
	return res == -1 ? -errno : 0;
}

static int cf_truncate(const char *path, off_t size, struct fuse_file_info *fi)
{
	int res;
	if (fi) {
		res = ftruncate((int) fi->fh, size);
	} else {
		int fd = openat(dfd(path), rel(path), O_WRONLY | O_CLOEXEC);
		if (fd == -1)
			return -errno;
		res = ftruncate(fd, size);
		int err = errno;
		close(fd);
		errno = err;
	}
	return res == -1 ? -errno : 0;
}

static int cf_utimens(const char *path, const struct timespec ts[2], struct fuse_file_info *fi)
{
	int res = fi ? futimens((int) fi->fh, ts) : utimensat(dfd(path), rel(path), ts, AT_SYMLINK_NOFOLLOW);
	return res == -1 ? -errno : 0;
}

static int cf_create(const char *path, mode_t mode, struct fuse_file_info *fi)
{
	int fd = openat(dfd(path), rel(path), fi->flags | O_NOFOLLOW | O_CLOEXEC, mode);
	if (fd == -1)
		return -errno;
	give_to_caller(rel(path));
	fi->fh = (uint64_t) fd;
	return 0;
}

static int cf_open(const char *path, struct fuse_file_info *fi)
{
	transit_wait(path);
	/* The name may have changed since the kernel's lookup: O_NOFOLLOW (kept from the caller, or
	 * added here) stops a symlink swapped in meanwhile from leading outside the backing dir. */
	int fd = openat(dfd(path), rel(path), fi->flags | O_NOFOLLOW | O_CLOEXEC);
	if (fd == -1)
		return -errno;
	fi->fh = (uint64_t) fd;
	return 0;
}

static int cf_read_buf(const char *path, struct fuse_bufvec **bufp, size_t size, off_t off,
		       struct fuse_file_info *fi)
{
	(void) path;
	struct fuse_bufvec *src = malloc(sizeof(*src));
	if (src == NULL)
		return -ENOMEM;
	*src = FUSE_BUFVEC_INIT(size);
	src->buf[0].flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK;
	src->buf[0].fd = (int) fi->fh;
	src->buf[0].pos = off;
	*bufp = src;
	return 0;
}

static int cf_write_buf(const char *path, struct fuse_bufvec *buf, off_t off, struct fuse_file_info *fi)
{
	(void) path;
	struct fuse_bufvec dst = FUSE_BUFVEC_INIT(fuse_buf_size(buf));
	dst.buf[0].flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK;
	dst.buf[0].fd = (int) fi->fh;
	dst.buf[0].pos = off;
	return (int) fuse_buf_copy(&dst, buf, FUSE_BUF_SPLICE_NONBLOCK);
}

static int cf_statfs(const char *path, struct statvfs *st)
{
	(void) path;
	return fstatvfs(g_base, st) == -1 ? -errno : 0;
}

static int cf_flush(const char *path, struct fuse_file_info *fi)
{
	(void) path;
	/* close() of a duplicate: what the backing filesystem does on each close, without closing ours. */
	return close(dup((int) fi->fh)) == -1 ? -errno : 0;
}

static int cf_release(const char *path, struct fuse_file_info *fi)
{
	(void) path;
	close((int) fi->fh);
	return 0;
}

static int cf_fsync(const char *path, int datasync, struct fuse_file_info *fi)
{
	(void) path;
	int fd = (int) fi->fh;
	fprintf(stderr, "casfs: FSYNC\n");
	return (datasync ? fdatasync(fd) : fsync(fd)) == -1 ? -errno : 0;
}

static int cf_fallocate(const char *path, int mode, off_t off, off_t len, struct fuse_file_info *fi)
{
	(void) path;
	return fallocate((int) fi->fh, mode, off, len) == -1 ? -errno : 0;
}

static ssize_t cf_copy_file_range(const char *pin, struct fuse_file_info *fin, off_t oin, const char *pout,
				  struct fuse_file_info *fout, off_t oout, size_t len, int flags)
{
	(void) pin;
	(void) pout;
	ssize_t n = copy_file_range((int) fin->fh, &oin, (int) fout->fh, &oout, len, (unsigned int) flags);
	return n == -1 ? -errno : n;
}

static off_t cf_lseek(const char *path, off_t off, int whence, struct fuse_file_info *fi)
{
	(void) path;
	off_t r = lseek((int) fi->fh, off, whence);
	return r == -1 ? -errno : r;
}

/* grant: yes to everyone.  (libfuse's high-level layer remembers granted POSIX
 * locks and may answer an F_GETLK from that table: the lie is in SETLK.) */
static int grant_lock(const char *path, struct fuse_file_info *fi, int cmd, struct flock *lk)
{
	(void) path;
	(void) fi;
	if (cmd == F_GETLK)
		lk->l_type = F_UNLCK;
	return 0;
}

static int grant_flock(const char *path, struct fuse_file_info *fi, int op)
{
	(void) path;
	(void) fi;
	(void) op;
	return 0;
}

static int enosys_lock(const char *path, struct fuse_file_info *fi, int cmd, struct flock *lk)
{
	(void) path;
	(void) fi;
	(void) cmd;
	(void) lk;
	return -ENOSYS;
}

static int enosys_flock(const char *path, struct fuse_file_info *fi, int op)
{
	(void) path;
	(void) fi;
	(void) op;
	return -ENOSYS;
}

/* EOF on stdin: the session that started us is gone; detach the mount so the loop ends. */
static void *watch_stdin(void *arg)
{
	(void) arg;
	char buf[64];
	for (;;) {
		ssize_t n = read(0, buf, sizeof(buf));
		if (n == 0 || (n == -1 && errno != EINTR))
			break;
	}
	if (umount2(g_mountpoint, MNT_DETACH) == -1)
		perror("casfs: umount2");
	return NULL;
}

/* BACKING<suffix>: a private directory beside the backing one (same filesystem: renames work). */
static int open_sibling(const char *backing, const char *suffix)
{
	size_t n = strlen(backing), m = strlen(suffix);
	char *dir = malloc(n + m + 1);
	if (dir == NULL)
		return -1;
	memcpy(dir, backing, n);
	memcpy(dir + n, suffix, m + 1);
	if (mkdir(dir, 0700) == -1 && errno != EEXIST) {
		perror(dir);
		free(dir);
		return -1;
	}
	int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fd == -1)
		perror(dir);
	free(dir);
	return fd;
}

int main(int argc, char *argv[])
{
	if (argc < 4) {
		fprintf(stderr, "usage: %s local|grant|enosys|delay_rename=MS BACKING MOUNTPOINT [fuse options]\n",
			argv[0]);
		return 2;
	}
	const char *mode = argv[1];
	if (strcmp(mode, "local") == 0) {
		g_mode = MODE_LOCAL;
	} else if (strcmp(mode, "grant") == 0) {
		g_mode = MODE_GRANT;
	} else if (strcmp(mode, "enosys") == 0) {
		g_mode = MODE_ENOSYS;
	} else if (strncmp(mode, "delay_rename=", 13) == 0) {
		char *end;
		g_mode = MODE_DELAY_RENAME;
		g_delay_ms = strtol(mode + 13, &end, 10);
		if (*end != '\0' || g_delay_ms < 0 || g_delay_ms > 60000) {
			fprintf(stderr, "casfs: bad delay in %s (milliseconds, 0..60000)\n", mode);
			return 2;
		}
	} else {
		fprintf(stderr, "casfs: unknown mode %s\n", mode);
		return 2;
	}
	g_base = open(argv[2], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (g_base == -1) {
		perror(argv[2]);
		return 2;
	}
	g_mountpoint = realpath(argv[3], NULL);
	if (g_mountpoint == NULL) {
		perror(argv[3]);
		return 2;
	}

	static struct fuse_operations ops;
	ops.init = cf_init;
	ops.getattr = cf_getattr;
	ops.access = cf_access;
	ops.readlink = cf_readlink;
	ops.opendir = cf_opendir;
	ops.readdir = cf_readdir;
	ops.releasedir = cf_releasedir;
	ops.fsyncdir = cf_fsyncdir;
	ops.mknod = cf_mknod;
	ops.mkdir = cf_mkdir;
	ops.unlink = cf_unlink;
	ops.rmdir = cf_rmdir;
	ops.symlink = cf_symlink;
	ops.rename = cf_rename;
	ops.link = cf_link;
	ops.chmod = cf_chmod;
	ops.chown = cf_chown;
	ops.truncate = cf_truncate;
	ops.utimens = cf_utimens;
	ops.create = cf_create;
	ops.open = cf_open;
	ops.read_buf = cf_read_buf;
	ops.write_buf = cf_write_buf;
	ops.statfs = cf_statfs;
	ops.flush = cf_flush;
	ops.release = cf_release;
	ops.fsync = cf_fsync;
	ops.fallocate = cf_fallocate;
	ops.copy_file_range = cf_copy_file_range;
	ops.lseek = cf_lseek;
	if (g_mode == MODE_GRANT) {
		ops.lock = grant_lock;
		ops.flock = grant_flock;
	} else if (g_mode == MODE_ENOSYS) {
		ops.lock = enosys_lock;
		ops.flock = enosys_flock;
	}
	/* local, delay_rename: no lock handlers, so the kernel keeps locks itself. */

	pthread_condattr_t tca;
	pthread_condattr_init(&tca);
	pthread_condattr_setclock(&tca, CLOCK_MONOTONIC);
	pthread_cond_init(&g_tcv, &tca);
	g_hidden = open_sibling(argv[2], ".hidden");
	if (g_hidden == -1)
		return 2;
	if (g_mode == MODE_DELAY_RENAME) {
		g_pending = open_sibling(argv[2], ".pending");
		if (g_pending == -1)
			return 2;
		pthread_condattr_t ca;
		pthread_condattr_init(&ca);
		pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
		pthread_cond_init(&g_cv, &ca);
		pthread_t lander;
		if (pthread_create(&lander, NULL, land_renames, NULL) != 0) {
			fprintf(stderr, "casfs: cannot start the rename thread\n");
			return 2;
		}
		pthread_detach(lander);
	}

	pthread_t watcher;
	if (pthread_create(&watcher, NULL, watch_stdin, NULL) != 0) {
		fprintf(stderr, "casfs: cannot start the stdin watcher\n");
		return 2;
	}
	pthread_detach(watcher);

	umask(0);
	/* fuse_main sees: prog MOUNTPOINT [options]; always foreground, multithreaded. */
	char **fargv = calloc((size_t) argc + 2, sizeof(char *));
	if (fargv == NULL)
		return 2;
	int fargc = 0;
	fargv[fargc++] = argv[0];
	fargv[fargc++] = g_mountpoint;
	fargv[fargc++] = "-f";
	for (int i = 4; i < argc; i++)
		fargv[fargc++] = argv[i];
	fargv[fargc] = NULL;
	return fuse_main(fargc, fargv, &ops, NULL);
}
