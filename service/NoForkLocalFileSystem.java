package onceflow.hadoop;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.attribute.PosixFilePermission;
import java.util.EnumSet;
import java.util.Set;
import org.apache.hadoop.fs.LocalFileSystem;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.RawLocalFileSystem;
import org.apache.hadoop.fs.permission.FsPermission;

/**
 * Hadoop's local file system (checksummed, as LocalFileSystem), setting a file's permission
 * with a system call instead of a forked `chmod` process.
 *
 * Without Hadoop's native library (PySpark ships none), RawLocalFileSystem runs `chmod` for
 * every file it creates with a permission, which is every checkpoint file: a process start
 * per offset log, commit log and state changelog file of every epoch.
 */
public class NoForkLocalFileSystem extends LocalFileSystem {
  private static final PosixFilePermission[] BITS = {
    PosixFilePermission.OTHERS_EXECUTE, PosixFilePermission.OTHERS_WRITE,
    PosixFilePermission.OTHERS_READ, PosixFilePermission.GROUP_EXECUTE,
    PosixFilePermission.GROUP_WRITE, PosixFilePermission.GROUP_READ,
    PosixFilePermission.OWNER_EXECUTE, PosixFilePermission.OWNER_WRITE,
    PosixFilePermission.OWNER_READ,
  };

  public NoForkLocalFileSystem() {
    super(new Raw());
  }

  /** The raw file system under the checksums. */
  public static class Raw extends RawLocalFileSystem {
    @Override
    public void setPermission(Path p, FsPermission permission) throws IOException {
      short mode = permission.toShort();
      if ((mode & ~0777) != 0) { // the sticky bit: only chmod sets it
        super.setPermission(p, permission);
        return;
      }
      Set<PosixFilePermission> set = EnumSet.noneOf(PosixFilePermission.class);
      for (int bit = 0; bit < BITS.length; bit++) {
        if ((mode & (1 << bit)) != 0) {
          set.add(BITS[bit]);
        }
      }
      Files.setPosixFilePermissions(pathToFile(p).toPath(), set);
    }
  }
}
